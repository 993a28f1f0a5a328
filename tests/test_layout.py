"""The engine-layout contract, pure: regions, the one slice function, rank layouts, staging sets.

Full tensors are filled with distinct values (arange) so any misplaced element shows.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from megatron_sync.convert import BUILTIN_FAMILIES, get_converter
from megatron_sync.layout.rank import ParamSpec, Placement, RankLayout, placements_of_copy
from megatron_sync.layout.regions import (
    VOCAB_BLOCKS, VOCAB_WHOLE, Region, Shard, Sharding, TensorSpec, even_range, expert_range, kv_head_range,
    padded_vocab_range, weight_region,
)
from megatron_sync.layout.roles import RoleLayout
from megatron_sync.layout.staging import StagedCopy, StagingSets, copies_shards, resolve_staging_sets
from tests.support import models


def _arange(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float64).to(dtype).view(shape)


# ---- regions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim,start,length", [((8, 4), 0, 2, 3), ((8, 4), 1, 1, 2), ((3, 4, 5), 1, 1, 2),
                                                    ((6,), 0, 4, 2), ((4, 6), 1, 0, 6)])
def test_a_box_region_is_the_narrowed_tensor(shape, dim, start, length):
    full = _arange(shape)
    region = Region.box(shape, dim, start, length)
    assert torch.equal(region.of(full), full.narrow(dim, start, length))
    assert region.fits(shape) and region.numel == full.narrow(dim, start, length).numel()
    assert region.is_contiguous() == full.narrow(dim, start, length).is_contiguous()
    assert Region.from_wire(region.to_wire()) == region


def test_rows_of_a_region_and_a_region_outside_the_tensor():
    full = _arange((8, 6))
    region = Region.box((8, 6), 1, 2, 3)
    assert torch.equal(region.rows(5, 2).of(full), full[5:7, 2:5])
    assert not Region(40, (2, 6), (6, 1)).fits((8, 6)) and Region(36, (2, 6), (6, 1)).fits((8, 6))
    assert Region.whole(()).rows(0, 1).of(torch.tensor(3.0)).item() == 3.0


@pytest.mark.parametrize("size,rank,parts,want", [(8, 0, 2, (0, 4)), (8, 1, 2, (4, 4)), (6, 2, 3, (4, 2))])
def test_even_range(size, rank, parts, want):
    assert even_range(size, rank, parts) == want


@pytest.mark.parametrize("kv,tp,starts", [(2, 1, [0]), (2, 2, [0, 16]), (2, 4, [0, 0, 16, 16]), (1, 2, [0, 0]),
                                          (4, 2, [0, 32])])
def test_kv_heads_are_replicated_when_tp_exceeds_them(kv, tp, starts):
    ranges = [kv_head_range(kv * 16, kv, r, tp) for r in range(tp)]
    assert [start for start, _ in ranges] == starts
    assert {length for _, length in ranges} == {max(16, kv * 16 // tp)}


def test_indivisible_shapes_name_the_fix():
    with pytest.raises(ValueError, match="tp_size=3; pick a tp_size that divides it"):
        even_range(8, 0, 3, what="w")
    with pytest.raises(ValueError, match="one must divide the other"):
        kv_head_range(48, 3, 0, 2)


@pytest.mark.parametrize("vocab,tp,padding", [(250, 1, 64), (250, 2, 64), (250, 4, 64), (1000, 4, 64),
                                               (130, 4, 64), (256, 2, 64), (151936, 8, 64)])
def test_padded_vocab_range_matches_vllms_own_indices(vocab, tp, padding):
    vpe = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")  # a requirement
    padded = math.ceil(vocab / padding) * padding
    for rank in range(tp):
        start, length, per_rank = padded_vocab_range(vocab, rank, tp, padding)
        ref = vpe.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
        assert (start, start + length) == (ref.org_vocab_start_index, ref.org_vocab_end_index)
        assert per_rank == ref.num_elements_padded


@pytest.mark.parametrize("experts,ep", [(8, 2), (8, 3), (5, 4), (16, 8)])
def test_expert_range_matches_vllms_expert_map(experts, ep):
    fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.expert_map_manager")
    for rank in range(ep):
        _, expert_map, _ = fused_moe.determine_expert_map(ep, rank, experts)
        assert list(expert_range(experts, rank, ep)) == [e for e in range(experts) if expert_map[e] >= 0]


# ---- a weight's parts are cut with the weight ----------------------------------------------------

def test_block_scales_and_packed_words_follow_their_weight_rows_and_columns():
    scale = TensorSpec("w.weight_scale_inv", (3, 2), torch.float32, Shard.COLUMN, (300, 256), (128, 128))
    assert weight_region(scale, 0, 256, 44) == Region.box((3, 2), 0, 2, 1)  # the last, partial block
    packed = TensorSpec("w.weight_packed", (64, 32), torch.int32, Shard.ROW, (64, 256), (1, 8))
    assert weight_region(packed, 1, 128, 128) == Region.box((64, 32), 1, 16, 16)
    shape = TensorSpec("w.weight_shape", (2,), torch.int64, Shard.ROW, (64, 256), None, True)
    assert weight_region(shape, 1, 128, 128) == Region.whole((2,))
    with pytest.raises(ValueError, match="falls inside a quantization block or group of 128"):
        weight_region(scale, 0, 64, 64)


@pytest.mark.parametrize("config", ["fp8_block", "int4"])
def test_converter_specs_are_its_expected_tensors_with_their_weights_roles(config):
    from tests.support.quant_refs import FP8_BLOCK, INT4_EXPERTS

    family, quant = ("deepseek_v3", FP8_BLOCK) if config == "fp8_block" else ("qwen3_moe", INT4_EXPERTS)
    cfg = models.hf_config(models.ModelSpec(family=family)).to_dict()
    cfg["quantization_config"] = quant
    converter = get_converter(family, cfg)
    specs = converter.tensor_specs()
    assert [(s.name, s.shape, s.dtype) for s in specs] == [(m.name, m.shape, m.dtype) for m in converter.expected_metas()]
    parts = [s for s in specs if s.weight_shape is not None]
    assert parts and all(s.role is converter.shard_role(converter.weight_of(s.name)) for s in parts)
    experts = converter.config[converter.family.num_experts_key]
    assert {s.expert for s in specs if ".experts." in s.name} == set(range(experts))


# ---- rank layouts -------------------------------------------------------------------------------

def _layout_of_one_param() -> tuple[RankLayout, dict[str, torch.Tensor]]:
    """A param [6, 4] holding rows 2..4 of a [5, 4] tensor "a" and, in its last two columns of rows 3..5,
    columns 1..2 of rows 0..2 of a [3, 3] tensor "b" (a destination that is not one contiguous run)."""
    param = ParamSpec("fused", (6, 4), torch.float32)
    full = {"a": _arange((5, 4)), "b": _arange((3, 3)) + 100}
    placements = [Placement("a", Region.box((5, 4), 0, 2, 3), "fused", 0, 3 * 4 * 4)]
    placements += placements_of_copy("b", Region(1, (3, 2), (3, 1)), param, Region(3 * 4 + 2, (3, 2), (4, 1)))
    return RankLayout((param,), tuple(placements)), full


def test_a_non_contiguous_destination_becomes_one_placement_per_run_and_lands_exactly():
    layout, full = _layout_of_one_param()
    assert len(layout.placements) == 1 + 3  # one run per destination row
    staging = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copied = sum(layout.write(staging, name, tensor) for name, tensor in full.items())
    want = torch.zeros(6, 4)
    want[0:3] = full["a"][2:5]
    want[3:6, 2:4] = full["b"][0:3, 1:3]
    assert torch.equal(layout.param_views(staging)["fused"], want)
    assert copied == layout.shard_bytes == (12 + 6) * 4
    assert torch.equal(layout.params_from(full)["fused"], want)
    assert RankLayout.from_wire(layout.to_wire()) == layout and RankLayout.from_wire(layout.to_wire()).digest() == layout.digest()


def test_params_start_aligned_in_the_staging_buffer():
    params = tuple(ParamSpec(f"p{i}", (n,), torch.bfloat16) for i, n in enumerate((3, 5, 64, 1)))
    layout = RankLayout(params, ())
    assert all(offset % 64 == 0 for offset in layout.param_offsets.values())
    assert layout.nbytes % 64 == 0 and layout.nbytes >= sum(p.nbytes for p in params)


@pytest.mark.parametrize("sent,words", [
    ({"a": TensorSpec("a", (5, 4), torch.float32)}, "b (into fused): the trainer does not produce it"),
    ({"a": TensorSpec("a", (5, 4), torch.bfloat16), "b": TensorSpec("b", (3, 3), torch.float32)},
     "a: the trainer sends bfloat16, fused holds float32"),
    ({"a": TensorSpec("a", (4, 4), torch.float32), "b": TensorSpec("b", (3, 3), torch.float32)},
     "outside the trainer's shape (4, 4)"),
])
def test_a_layout_that_does_not_fit_the_trainers_tensors_is_refused_naming_them(sent, words):
    layout, _ = _layout_of_one_param()
    with pytest.raises(ValueError, match="rank 3: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        layout.check_against(sent, who="rank 3")
    layout.check_against({"a": TensorSpec("a", (5, 4), torch.float32), "b": TensorSpec("b", (3, 3), torch.float32)},
                         who="rank 3")


# ---- role layouts: the reference engine and the vLLM-shaped planning layout ----------------------

@pytest.mark.parametrize("family", BUILTIN_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_element_of_every_tensor_lands_on_a_rank_and_shard_bytes_add_up(family, tp):
    cfg = models.hf_config(models.ModelSpec(family=family, num_kv_heads=2))
    specs = get_converter(family, cfg).tensor_specs()
    for vocab in (VOCAB_WHOLE, VOCAB_BLOCKS):
        for ep in (False, True):
            engine = RoleLayout(Sharding(tp, 2, vocab), expert_parallel=ep)
            seen = {s.name: torch.zeros(s.shape, dtype=torch.int32) for s in specs}
            for rank in range(tp):
                layout = engine.rank_layout(specs, rank)
                assert layout.shard_bytes == sum(p.nbytes for p in layout.params)
                for p in layout.placements:
                    p.source.of(seen[p.name]).add_(1)
            for spec in specs:
                whole = spec.role is Shard.REPLICATED or (spec.role is Shard.VOCAB and vocab == VOCAB_WHOLE) \
                    or tp == 1 or spec.whole
                kv_copies = tp // 2 if spec.role is Shard.KV_HEADS and tp > 2 else 1
                want = tp if whole and not (ep and spec.expert is not None) else kv_copies
                assert bool((seen[spec.name] == want).all()), (spec.name, vocab, ep)


def test_the_reference_engine_holds_its_layouts_params():
    from megatron_sync.engines.reference.engine import ReferenceEngine

    cfg = models.hf_config(models.ModelSpec(family="qwen3_moe", num_kv_heads=2))
    for rank in range(2):
        engine = ReferenceEngine(cfg, tp_rank=rank, tp_size=2, dtype=torch.bfloat16)
        layout = engine.rank_layout()
        assert layout == RoleLayout(Sharding(2, 2, VOCAB_WHOLE)).rank_layout(engine.converter.tensor_specs(), rank)
        live = engine.snapshot()
        assert {p.name: (p.shape, p.dtype) for p in layout.params} == {n: (tuple(t.shape), t.dtype) for n, t in live.items()}


# ---- staging sets ---------------------------------------------------------------------------------

def test_staging_sets_alternate_and_keep_the_live_version_for_a_rollback():
    layout, full = _layout_of_one_param()
    sets = StagingSets(layout, lambda n: torch.full((n,), 7, dtype=torch.uint8))
    assert not sets.memory.any()  # zeroed: bytes no region lands in stay zero
    first = sets.begin()
    sets.write("a", full["a"])
    assert sets.live_params(0) is None
    sets.committed(1)
    assert sets.live_params(1) is first and sets.target == 1
    second = sets.begin()
    assert second is not first and second["fused"].data_ptr() != first["fused"].data_ptr()
    sets.write("a", full["a"] * 2)  # a version that is never committed: the live set is untouched
    assert torch.equal(sets.live_params(1)["fused"][:3], full["a"][2:5]) and sets.target == 1
    sets.committed(2)
    assert sets.live_params(2) is second and sets.live_params(1) is None and sets.nbytes == 2 * layout.nbytes


def test_one_staging_set_keeps_a_host_copy_of_the_live_version_as_its_rollback_source():
    layout, full = _layout_of_one_param()
    sets = StagingSets(layout, lambda n: torch.empty((n,), dtype=torch.uint8), 1)
    assert sets.nbytes == layout.nbytes and sets.host_bytes == layout.nbytes
    first = sets.begin()
    assert isinstance(first, StagedCopy) and first.previous is None  # the first version: no host copy yet
    sets.write("a", full["a"])
    sets.committed(1)  # the host copy of version 1 starts
    assert sets.live_params(1) is first and sets.target == 0
    assert torch.equal(sets.live_buffer(1), sets.memory)  # between syncs the set is version 1: relays read it
    second = sets.begin()  # waits for the host copy: from here on it is version 1's only copy
    assert second is first and sets.live_buffer(1) is None
    sets.write("a", full["a"] * 2)  # version 2 overwrites the one set
    kept = sets.live_params(1)
    assert not isinstance(kept, StagedCopy) and kept["fused"].data_ptr() != first["fused"].data_ptr()
    assert torch.equal(kept["fused"][:3], full["a"][2:5]) and not torch.equal(first["fused"][:3], full["a"][2:5])
    assert second.previous is not None and torch.equal(second.previous["fused"], kept["fused"])
    sets.committed(2)
    sets.begin()
    assert torch.equal(sets.live_params(2)["fused"][:3], full["a"][2:5] * 2)  # the host copy moved on to version 2
    assert sets.live_params(1) is None


def test_staging_sets_other_than_one_or_two_are_refused_naming_the_choice():
    layout, _ = _layout_of_one_param()
    for count, match in ((3, r"StagingSets holds 1 or 2 sets, got 3"), ("auto", r"got 'auto' \(resolve weight_sync")):
        with pytest.raises(ValueError, match=match):
            StagingSets(layout, lambda n: torch.empty((n,), dtype=torch.uint8), count)


def test_auto_staging_sets_are_one_for_an_engine_that_copies_and_two_for_one_that_may_run_on_a_set():
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.engines.vllm.adapter import VLLMModelAdapter

    assert copies_shards(VLLMModelAdapter) and not copies_shards(ReferenceEngine) and not copies_shards(object())
    assert [resolve_staging_sets("auto", copies=c) for c in (True, False)] == [1, 2]
    assert [resolve_staging_sets(n, copies=c) for n in (1, 2) for c in (True, False)] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"staging_sets=0: use \"auto\""):
        resolve_staging_sets(0, copies=True)
    # over P2P the trainer's options carry "auto" and every rank resolves it at the handshake alike
    from megatron_sync.transports.p2p.schedule import ScheduleOptions

    options = ScheduleOptions(piece_bytes=4096, staging_sets="auto")
    assert options.resolved(copies=True).staging_sets == 1 and options.resolved(copies=False).staging_sets == 2
    assert options.resolved(copies=True).posts_base and not options.resolved(copies=False).posts_base
    # a schedule is never built on an unresolved "auto": every rank must agree on the number of sets
    from megatron_sync.transports.p2p.build import build_schedule

    with pytest.raises(ValueError, match=r"staging_sets='auto' in the schedule's options: resolve it"):
        build_schedule((), (), (), (), options)
