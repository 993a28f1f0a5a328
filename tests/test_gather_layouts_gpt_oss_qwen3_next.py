"""Tier 2 for gpt-oss and Qwen3-Next: every parallel layout yields exactly what a single-rank run yields.

As tests/test_gather_layouts.py, for the two families whose tensors need more than the attributes
megatron-core sets on its parameters: attention sinks split over TP with no TP attribute, and a
gated-delta-net in_proj / conv1d whose TP shards each hold a part of every q/k/v/z/beta/alpha piece
(a plain concatenation of shards would be a different, TP-dependent tensor). gpt-oss's expert
biases need expert TP 1 in megatron-core 0.16.1, so its TP layouts keep ETP=1.

The test loader slices the reference weights with the walk's own view of each split, so this test
shows gather + convert reproduce the single-rank bytes; that the walk's view is megatron-core's
(each rank's shard holding its part of every piece) is shown by tests/test_hf_logits.py
at TP=2, where Megatron computes with those shards (a plain split of in_proj moves its logits by 5).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_distributed

FAMILIES = ("gpt_oss", "qwen3_next")
SMALL_BUDGET = 4096  # bytes: one tensor per batch, and the large GDN in_proj gathered in pieces


def _spec(family: str):
    from tests.support.models import ModelSpec

    return ModelSpec(family=family, rms_norm_eps=1e-5)


def _stream_family(family: str, layout_kw: dict, budget: int):
    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models

    spec = _spec(family)
    chunks = models.build_model_chunks(spec, vpp=layout_kw.get("vpp"))
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=7), spec)
    converter = get_converter(family, models.hf_config(spec), dtype=torch.bfloat16)
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(), converter, gather_budget_bytes=budget)
    return {name: tensor.clone() for name, tensor in stream}


def _worker(rank, world_size, layout_kw, budget):
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    return {family: _stream_family(family, layout_kw, budget) for family in FAMILIES}


@pytest.fixture(scope="module")
def reference():
    """Single-rank conversion of both families: the bytes every layout must reproduce."""
    [out] = run_distributed(_worker, 1, {}, SMALL_BUDGET, timeout=240)
    return out


LAYOUTS = [
    pytest.param(2, dict(tp=2, etp=1), id="tp2"),
    pytest.param(2, dict(ep=2), id="ep2"),
    pytest.param(4, dict(tp=2, etp=1, ep=2), id="tp2-ep2"),
    pytest.param(2, dict(pp=2), id="pp2"),
    pytest.param(4, dict(pp=2, vpp=2), id="pp2-vpp2"),
]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size,layout_kw", LAYOUTS)
def test_layout_yields_single_rank_tensors(reference, world_size, layout_kw):
    per_rank = run_distributed(_worker, world_size, layout_kw, SMALL_BUDGET, timeout=300)
    for family in FAMILIES:
        merged: dict[str, torch.Tensor] = {}
        for out in per_rank:
            assert not set(out[family]) & set(merged), f"{family}: a tensor came from two ranks"
            merged.update(out[family])
        want = reference[family]
        assert set(merged) == set(want), (
            f"{family}: missing {sorted(set(want) - set(merged))[:5]}, unexpected {sorted(set(merged) - set(want))[:5]}"
        )
        for name, tensor in want.items():
            assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), f"{family}: {name}"
