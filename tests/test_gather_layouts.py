"""Tier 2: every parallel layout yields exactly what a single-rank run of the same model yields.

Each layout runs once in gloo processes with all families in one go (process
start-up dominates on 2 cores). Weights come from one seeded full state dict,
sliced into each rank's shards by the independent test loader; the library's
gather + convert must reproduce, bit for bit, the single-rank conversion.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.core.grid import Grid
from tests.support.dist import run_distributed

DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen3_moe", "deepseek_v3", "glm4_moe_mtp", "deepseek_v3_mtp", "kimi_k2")
SMALL_BUDGET = 4096  # bytes: forces one-tensor batches, so the memory bound is tight


def _spec(case: str):
    """The tiny model of a case: a family's default, or one of the variants below."""
    from tests.support import models

    variants = {
        # GLM-4.5 with partial rotary and one MTP draft layer (on the last pipeline stage, with the
        # stage's embedding copy under PP), DeepSeek-V3 with its MTP layer, Kimi-K2's shape (32 experts)
        "glm4_moe_mtp": dict(family="glm4_moe", partial_rotary_factor=0.5, mtp_layers=1),
        "deepseek_v3_mtp": dict(family="deepseek_v3", mtp_layers=1),
        "kimi_k2": models.KIMI_K2,
    }
    return models.ModelSpec(**variants.get(case, dict(family=case)))


def _stream_family(family: str, layout_kw: dict, budget: int):
    from megatron_sync.convert import get_converter
    from megatron_sync.trainer.gather import GatherMemoryTracker
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models

    spec = _spec(family)
    chunks = models.build_model_chunks(spec, vpp=layout_kw.get("vpp"))
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=7), spec)
    layout = ParallelLayout.from_megatron()
    converter = get_converter(spec.family, models.hf_config(spec), dtype=torch.bfloat16)
    tracker = GatherMemoryTracker()
    stream = MegatronWeightStream(chunks, layout, converter, gather_budget_bytes=budget, tracker=tracker)
    produced = {name: tensor.clone() for name, tensor in stream}
    announced = [m.name for m in stream.metadata()]
    assert list(produced) == announced, "iteration order differs from metadata()"
    return {"tensors": produced, "peak": tracker.peak, "largest": tracker.largest_tensor}


def _worker(rank, world_size, layout_kw, families, budget):
    from megatron_sync.core.grid import ParallelLayout, TrainerRank
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    layout = ParallelLayout.from_megatron()  # this rank's place, as Megatron reports it
    grid = {"live": TrainerRank.of(layout, rank), "grid": layout.grid}
    return {"grid": grid, **{family: _stream_family(family, layout_kw, budget) for family in families}}


@pytest.fixture(scope="module")
def reference():
    """Single-rank conversion of every family: the bytes every layout must reproduce."""
    [out] = run_distributed(_worker, 1, {}, DENSE + MOE, SMALL_BUDGET, timeout=360)
    return {family: r["tensors"] for family, r in out.items() if family != "grid"}


LARGE_BUDGET = 1 << 20  # many tensors per batch

LAYOUTS = [
    pytest.param(1, dict(), DENSE + MOE, id="single-rank-large-budget"),
    pytest.param(2, dict(tp=2), DENSE + MOE, id="tp2"),
    pytest.param(2, dict(ep=2), MOE, id="ep2"),
    pytest.param(4, dict(ep=4), MOE, id="ep4"),
    pytest.param(4, dict(tp=2, ep=2), MOE, id="tp2-ep2"),
    pytest.param(4, dict(ep=2, etp=2), MOE, id="ep2-etp2"),
    pytest.param(2, dict(pp=2), DENSE + MOE, id="pp2"),
    pytest.param(4, dict(pp=2, vpp=2), DENSE + MOE, id="pp2-vpp2"),
    pytest.param(4, dict(tp=2), DENSE + MOE, id="tp2-dp2"),
]


@pytest.mark.multiproc
@pytest.mark.timeout(540)
@pytest.mark.parametrize("world_size,layout_kw,families", LAYOUTS)
def test_layout_yields_single_rank_tensors(reference, world_size, layout_kw, families):
    budget = LARGE_BUDGET if world_size == 1 else SMALL_BUDGET
    per_rank = run_distributed(_worker, world_size, layout_kw, families, budget, timeout=420)
    grid = per_rank[0]["grid"]["grid"]  # the one grid: its rank order is Megatron's, coordinate by coordinate
    sizes = {"etp": layout_kw.get("tp", 1), **layout_kw}  # megatron-core's expert TP defaults to the dense TP
    assert grid.world == world_size and grid == Grid(dp=world_size // (grid.tp * grid.pp), **sizes), grid
    assert [out["grid"]["live"] for out in per_rank] == grid.ranks()
    for family in families:
        merged: dict[str, torch.Tensor] = {}
        for out in per_rank:
            tensors = out[family]["tensors"]
            assert not set(tensors) & set(merged), f"{family}: a tensor came from two ranks"
            merged.update(tensors)
        want = reference[family]
        assert set(merged) == set(want), (
            f"{family}: missing {sorted(set(want) - set(merged))[:5]}, "
            f"unexpected {sorted(set(merged) - set(want))[:5]}"
        )
        for name, tensor in want.items():
            assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), f"{family}: {name}"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [SMALL_BUDGET, 64 * 1024])
def test_gathered_bytes_stay_within_budget_plus_largest_tensor(budget):
    per_rank = run_distributed(_worker, 4, dict(tp=2, ep=2), ("qwen3_moe",), budget, timeout=240)
    source = per_rank[0]["qwen3_moe"]
    assert source["largest"] > 0
    assert source["peak"] <= budget + source["largest"]
    for other in per_rank[1:]:
        assert other["qwen3_moe"]["tensors"] == {}
    if budget > source["largest"]:
        # A budget above one tensor is actually used: several tensors gathered per collective.
        assert source["peak"] > source["largest"]


def _start_up_errors(rank, world_size):
    """Worker: three bad set-ups of the weight stream; return each rank's error text."""
    import dataclasses

    from megatron_sync.convert import get_converter
    from megatron_sync.core.agreement import AgreedFailure
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream, check_model_complete
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(tp=2)
    spec = models.ModelSpec(family="qwen3")
    chunks = models.build_model_chunks(spec)
    layout = ParallelLayout.from_megatron()
    errors = {}
    wrong_family = get_converter("llama", models.hf_config(dataclasses.replace(spec, family="llama")))
    wider = get_converter("qwen3", models.hf_config(dataclasses.replace(spec, hidden_size=96)))
    for case, converter in (("unmapped", wrong_family), ("shape", wider)):
        try:
            MegatronWeightStream(chunks, layout, converter)
        except AgreedFailure as e:
            errors[case] = str(e)
    skipping = get_converter("qwen3", models.hf_config(spec), skip=["decoder.final_layernorm.weight"])
    stream = MegatronWeightStream(chunks, layout, skipping)
    try:
        if stream.is_source:
            check_model_complete([stream.metadata()], skipping)
    except ValueError as e:
        errors["missing"] = str(e)
    return errors


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_bad_names_and_shapes_fail_on_every_rank_before_data_moves():
    rank0, rank1 = run_distributed(_start_up_errors, 2, timeout=150)
    for errors in (rank0, rank1):  # both ranks raise, naming the parameter and the fix
        assert "self_attention.q_layernorm.weight" in errors["unmapped"] and "skip" in errors["unmapped"]
        assert "hidden_size" in errors["shape"]
    assert "model.norm.weight" in rank0["missing"]


class _FailsOn:
    """A converter that raises on one Megatron name (a stand-in for a bad value found mid-sync)."""

    def __init__(self, converter, name):
        self._converter, self._name = converter, name

    def __getattr__(self, attr):
        return getattr(self._converter, attr)

    def convert(self, name, tensor):
        if name == self._name:
            raise ValueError(f"refusing to convert {name}")
        return self._converter.convert(name, tensor)


def _convert_fails_mid_stream(rank, world_size):
    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(tp=2)
    spec = models.ModelSpec(family="qwen3")
    chunks = models.build_model_chunks(spec)
    converter = _FailsOn(get_converter("qwen3", models.hf_config(spec)), "decoder.layers.0.mlp.linear_fc1.weight")
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(), converter, gather_budget_bytes=4096)
    try:
        count = sum(1 for _ in stream)
    except ValueError as e:
        return f"raised: {e}"
    return f"walked: {count}"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_conversion_error_mid_stream_still_finishes_the_collectives():
    # Rank 1 only takes part in gathers; it must not be left waiting in one when rank 0 fails.
    rank0, rank1 = run_distributed(_convert_fails_mid_stream, 2, timeout=90)
    assert rank0 == "raised: refusing to convert decoder.layers.0.mlp.linear_fc1.weight"
    assert rank1 == "walked: 0"


def _gather_to_some(rank, world_size):
    from megatron_sync.trainer.gather import GatherMemoryTracker, GatherUnit, gather_in_pieces, gather_to
    from megatron_sync.trainer.source import Split

    group = torch.distributed.new_group(list(range(world_size)))
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    got = {to: gather_to(mine, group, world_size, rank, to) for to in [(0, 2), (1,), (0, 1, 2)]}
    full_shape = (2 * world_size, 3)  # split along dim 0; pieces of one row each run along dim 1
    unit = GatherUnit("w", full_shape, torch.float32, Split("tp", 0, 1), mine, torch.device("cpu"))
    full = gather_in_pieces(unit, group, world_size, rank, budget_bytes=2 * 4 * world_size * 2,
                            tracker=GatherMemoryTracker(), to=(1, 2))
    return {"got": {str(to): None if s is None else [t.tolist() for t in s] for to, s in got.items()},
            "full": None if full is None else full.tolist()}


@pytest.mark.multiproc
def test_a_gather_reaches_only_the_ranks_it_is_for():
    """`gather_to` (the P2P walk's gather: a unit's shards go to the ranks that write it) and
    `gather_in_pieces` with a subset of the group: exact shards there, nothing elsewhere."""
    results = run_distributed(_gather_to_some, 3, timeout=120)
    shards = [(torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r).tolist() for r in range(3)]
    for rank, result in enumerate(results):
        for to in [(0, 2), (1,), (0, 1, 2)]:
            assert result["got"][str(to)] == (shards if rank in to else None), (rank, to)
        assert result["full"] == ([row for s in shards for row in s] if rank in (1, 2) else None), rank
