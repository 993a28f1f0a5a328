"""Receiver layouts: the reference engine's shards bit for bit, and vLLM's stacked per-rank params.

Full tensors are filled with distinct values (arange) so any misplaced row shows.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from converters import BUILTIN_FAMILIES
from megatron_sync.p2p.layout import (
    ReferenceLayout, Region, Shard, TensorSpec, VllmLayout, even_region, kv_head_region,
    linear_expert_range, tensor_specs, vllm_vocab_rows,
)
from tests.support import models


def _specs(family: str, **spec_kw) -> tuple[list[TensorSpec], object]:
    from converters import get_converter

    spec = models.ModelSpec(family=family, **spec_kw)
    cfg = models.hf_config(spec)
    return tensor_specs(get_converter(family, cfg)), cfg


def _full(spec: TensorSpec) -> torch.Tensor:
    return torch.arange(math.prod(spec.shape), dtype=torch.float64).remainder(9973).to(spec.dtype).view(spec.shape)


def _stage(layout, specs, rank) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Write every region a rank needs into a zeroed staging buffer, as a transport would."""
    rank_layout = layout.rank_layout(specs, rank)
    staging = torch.zeros(rank_layout.nbytes, dtype=torch.uint8)
    by_name = {s.name: s for s in specs}
    offsets = rank_layout.param_offsets()
    for pl in rank_layout.placements:
        data = pl.region.of(_full(by_name[pl.name])).contiguous().view(-1).view(torch.uint8)
        assert data.numel() == pl.nbytes
        at = offsets[pl.param] + pl.offset
        staging[at:at + pl.nbytes] = data
    return staging, rank_layout.param_views(staging)


# ---- pure regions, as tables -----------------------------------------------------------------

def _t(shape, role=Shard.COLUMN) -> TensorSpec:
    return TensorSpec("t", shape, torch.float32, role)


@pytest.mark.parametrize("shape,dim,rank,parts,want", [
    ((8, 4), 0, 0, 2, Region(0, 0, 4)),
    ((8, 4), 0, 1, 2, Region(0, 4, 4)),
    ((8, 4), 1, 3, 4, Region(1, 3, 1)),
    ((6,), 0, 2, 3, Region(0, 4, 2)),
])
def test_even_region(shape, dim, rank, parts, want):
    assert even_region(_t(shape), dim, rank, parts) == want


@pytest.mark.parametrize("kv,tp,starts", [
    (2, 1, [0]),
    (2, 2, [0, 16]),
    (2, 4, [0, 0, 16, 16]),  # each head on tp / kv = 2 consecutive ranks
    (1, 2, [0, 0]),
    (4, 2, [0, 32]),
])
def test_kv_head_region_replicates_heads_when_tp_exceeds_them(kv, tp, starts):
    spec = _t((kv * 16, 8), Shard.KV_HEADS)
    regions = [kv_head_region(spec, kv, r, tp) for r in range(tp)]
    assert [r.start for r in regions] == starts
    assert {r.length for r in regions} == {max(16, kv * 16 // tp)}


def test_indivisible_shapes_name_the_fix():
    with pytest.raises(ValueError, match="tp_size=3"):
        even_region(_t((8, 4)), 0, 0, 3)
    with pytest.raises(ValueError, match="one must divide the other"):
        kv_head_region(_t((48, 4), Shard.KV_HEADS), 3, 0, 2)


@pytest.mark.parametrize("vocab,tp,padding", [(250, 1, 64), (250, 2, 64), (250, 4, 64), (1000, 4, 64),
                                               (130, 4, 64), (256, 2, 64), (151936, 8, 64)])
def test_vllm_vocab_rows_match_vllms_own_indices(vocab, tp, padding):
    vpe = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")  # a requirement
    padded = math.ceil(vocab / padding) * padding
    for rank in range(tp):
        start, length, per_rank = vllm_vocab_rows(vocab, rank, tp, padding)
        ref = vpe.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
        assert (start, start + length) == (ref.org_vocab_start_index, ref.org_vocab_end_index)
        assert per_rank == ref.num_elements_padded


@pytest.mark.parametrize("experts,ep", [(8, 2), (8, 3), (5, 4), (16, 8)])
def test_linear_expert_range_matches_vllms_expert_map(experts, ep):
    fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.expert_map_manager")
    for rank in range(ep):
        _, expert_map, _ = fused_moe.determine_expert_map(ep, rank, experts)
        owned = [e for e in range(experts) if expert_map[e] >= 0]
        assert list(linear_expert_range(experts, rank, ep)) == owned


# ---- the reference engine, bit for bit ---------------------------------------------------------

@pytest.mark.parametrize("family", [f for f in BUILTIN_FAMILIES if f not in models.NOT_ON_REFERENCE_ENGINE])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reference_layout_reproduces_reference_engine_shard_of(family, tp):
    from megatron_sync.engines.base import LayoutEngine
    from megatron_sync.engines.reference import ReferenceEngine

    specs, cfg = _specs(family)
    for rank in range(tp):
        engine = ReferenceEngine(cfg, tp_rank=rank, tp_size=tp, dtype=torch.bfloat16)
        assert isinstance(engine, LayoutEngine)
        layout = engine.memory_layout()  # what the engine publishes to the P2P transport
        assert layout.to_wire() == ReferenceLayout(tp, num_kv_heads=cfg.num_key_value_heads).to_wire()
        dtypes = {m.name: m.dtype for m in engine.expected_tensors()}
        assert set(dtypes) == {s.name for s in specs}
        specs_here = [TensorSpec(s.name, s.shape, dtypes[s.name], s.role) for s in specs]
        _, params = _stage(layout, specs_here, rank)
        for spec in specs_here:
            want = engine.shard_of(spec.name, _full(spec))
            assert params[spec.name].dtype == want.dtype and torch.equal(params[spec.name], want), spec.name


def test_reference_layout_keeps_vocab_whole_and_counts_shard_bytes():
    specs, cfg = _specs("qwen3")
    layout = ReferenceLayout(2, num_kv_heads=cfg.num_key_value_heads)
    rank1 = layout.rank_layout(specs, 1)
    embed = next(p for p in rank1.placements if p.name == "model.embed_tokens.weight")
    assert embed.region == Region() and embed.nbytes == 250 * 64 * 2
    assert rank1.shard_bytes == sum(p.nbytes for p in rank1.params)
    assert rank1.nbytes >= rank1.shard_bytes and rank1.nbytes % 2 == 0


# ---- vLLM's per-rank params ------------------------------------------------------------------

def _chunk(t: torch.Tensor, rank: int, parts: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[rank]


def test_vllm_stacks_qkv_and_gate_up_per_rank_and_pads_vocab():
    specs, cfg = _specs("qwen3")  # 4 heads, 2 kv heads, head_dim 16, vocab 250
    full = {s.name: _full(s) for s in specs}
    layout = VllmLayout(4, num_kv_heads=2)
    a = "model.layers.1.self_attn."
    for rank in range(4):
        _, params = _stage(layout, specs, rank)
        k_head = full[a + "k_proj.weight"].chunk(2)[rank // 2]
        v_head = full[a + "v_proj.weight"].chunk(2)[rank // 2]
        want_qkv = torch.cat([_chunk(full[a + "q_proj.weight"], rank, 4), k_head, v_head])
        assert torch.equal(params[a + "qkv_proj.weight"], want_qkv)
        m = "model.layers.1.mlp."
        want_gate_up = torch.cat([_chunk(full[m + "gate_proj.weight"], rank, 4), _chunk(full[m + "up_proj.weight"], rank, 4)])
        assert torch.equal(params[m + "gate_up_proj.weight"], want_gate_up)
        assert torch.equal(params[m + "down_proj.weight"], _chunk(full[m + "down_proj.weight"], rank, 4, dim=1))
        embed = params["model.embed_tokens.weight"]  # 250 rows padded to 256: 64 per rank
        real = full["model.embed_tokens.weight"][rank * 64:(rank + 1) * 64]
        assert embed.shape == (64, 64) and torch.equal(embed[:len(real)], real)
        assert not embed[len(real):].any()
        assert a + "q_proj.weight" not in params and a + "q_norm.weight" in params


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_vllm_fuses_routed_experts_into_w13_and_w2(expert_parallel):
    specs, cfg = _specs("qwen3_moe")  # 8 experts, moe_intermediate 32
    full = {s.name: _full(s) for s in specs}
    tp = 2
    layout = VllmLayout(tp, num_kv_heads=2, expert_parallel=expert_parallel)
    x = "model.layers.0.mlp.experts."
    for rank in range(tp):
        _, params = _stage(layout, specs, rank)
        experts = range(rank * 4, rank * 4 + 4) if expert_parallel else range(8)
        for slot, e in enumerate(experts):
            gate, up, down = (full[f"{x}{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            if not expert_parallel:
                gate, up, down = _chunk(gate, rank, tp), _chunk(up, rank, tp), _chunk(down, rank, tp, dim=1)
            assert torch.equal(params[x + "w13_weight"][slot], torch.cat([gate, up]))
            assert torch.equal(params[x + "w2_weight"][slot], down)
        assert params[x + "w13_weight"].shape[0] == len(experts)


def test_vllm_keeps_mla_down_projections_stacked_and_replicated():
    specs, _ = _specs("deepseek_v3")
    full = {s.name: _full(s) for s in specs}
    a = "model.layers.1.self_attn."
    for rank in range(2):
        _, params = _stage(VllmLayout(2, num_kv_heads=4), specs, rank)
        want = torch.cat([full[a + "q_a_proj.weight"], full[a + "kv_a_proj_with_mqa.weight"]])
        assert torch.equal(params[a + "fused_qkv_a_proj.weight"], want)
        assert torch.equal(params[a + "kv_b_proj.weight"], _chunk(full[a + "kv_b_proj.weight"], rank, 2))


def test_vllm_pads_the_vocabulary_even_at_tp1():
    specs, _ = _specs("qwen3")
    _, params = _stage(VllmLayout(1, num_kv_heads=2), specs, 0)
    assert params["model.embed_tokens.weight"].shape == (256, 64)  # 250 rows padded to a multiple of 64
    assert not params["model.embed_tokens.weight"][250:].any()


def test_vllm_shard_bytes_exclude_padding():
    specs, _ = _specs("llama")
    layout = VllmLayout(4, num_kv_heads=2)
    total = 0
    for rank in range(4):
        r = layout.rank_layout(specs, rank)
        assert r.shard_bytes <= sum(p.nbytes for p in r.params)
        total += sum(p.nbytes for p in r.placements if p.name == "model.embed_tokens.weight")
    assert total == 250 * 64 * 2  # every real vocabulary row exactly once
