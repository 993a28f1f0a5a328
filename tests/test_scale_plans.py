"""The scale model's plans: the Megatron side against megatron-core's own parameters, the bundled configs
against the published parameter counts, disk-delta's reader chain (full size: tests/test_scale_p2p.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import MODELS, converter_for, model_named
from megatron_sync.scale.megatron_side import stage_units
from megatron_sync.scale.plans import ScalePlanner
from tests.support.dist import run_distributed
from tests.support.models import ModelSpec, hf_config

MOE_SPEC = dict(family="qwen3_moe", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                ffn_hidden_size=256, vocab_size=1000, num_experts=8, moe_ffn_hidden_size=64)


# ---------------------------------------------------------------- the Megatron side against megatron-core


def _real_units(rank: int, world: int, family: str, layout_kw: dict, spec_kw: dict) -> dict | None:
    """Build the tiny model under `layout_kw` and return stage 0's gather units as plan_gather_units
    lists them on rank 0 (HF outputs -> full shape, sharding, EP owner)."""
    from megatron_sync.convert import get_converter
    from megatron_sync.trainer.gather import plan_gather_units
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.source import walk_model_chunks
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    spec = models.ModelSpec(family=family, **spec_kw)
    chunks = models.build_model_chunks(spec)
    layout = ParallelLayout.from_megatron()
    converter = get_converter(family, models.hf_config(spec))
    tensors = walk_model_chunks(chunks, layout, is_buffer=converter.is_buffer)
    units = [u for u in plan_gather_units(tensors, layout) if not converter.is_skipped(u.name)]
    return _describe(units, converter) if rank == 0 else None


def _describe(units, converter) -> dict:
    out = {}
    for u in units:
        names = tuple(sorted(converter.weight_of(m.name) for m in converter.convert_meta(u.name, u.full_shape, u.dtype)))
        out[names] = (tuple(u.full_shape), u.sharding.axis, u.sharding.dim, u.sharding.stride, u.owner_ep)
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,layout,spec_kw", [
    ("qwen3", {"tp": 2}, {}), ("qwen3_moe", {"ep": 2}, {}), ("deepseek_v3", {"tp": 2}, {"mtp_layers": 1}),
    ("glm4_moe", {"ep": 2}, {"mtp_layers": 1})], ids=["qwen3-tp2", "qwen3_moe-ep2", "deepseek_v3-tp2-mtp",
                                                       "glm4_moe-ep2-mtp"])
def test_the_megatron_side_equals_megatron_cores_own_parameters(family, layout, spec_kw):
    """Derived from the family's rule table on meta tensors, every gather unit (its HF outputs, full
    shape with Megatron's vocabulary padding, TP/ETP sharding with gate/up's stride, EP owner; the MTP
    draft block's too) is the one megatron-core's model yields through the library's own source walk."""
    real = run_distributed(_real_units, 2, family, layout, spec_kw, timeout=240)[0]
    spec = ModelSpec(family=family, **spec_kw)
    converter = converter_for(family, hf_config(spec))
    trainer = TrainerLayout(tp=layout.get("tp", 1), ep=layout.get("ep", 1), dp=2 // layout.get("tp", 1))
    mine = _describe(stage_units(converter, trainer, torch.float32)[0], converter)
    assert mine == real


# ---------------------------------------------------------------- full scale on metadata


@pytest.mark.parametrize("name,params", [("deepseek-v3", 671e9), ("kimi-k2", 1.03e12), ("qwen3-235b-a22b", 235e9),
                                         ("glm-4.5", 355e9), ("qwen3-30b-a3b", 30.5e9), ("glm-4.5-air", 106e9)])
def test_bundled_configs_give_the_published_parameter_counts(name, params):
    """The bundled config.json files, through the families' tables, hold the published parameter counts of
    the main model (within 1%; the draft layers come on top: DeepSeek-V3's 14B make its 685B checkpoint)."""
    family, config = model_named(name)
    converter = converter_for(family, config, quantized=False, draft=False)
    counted = sum(m.numel for m in converter.expected_metas(quantized=False))
    assert abs(counted - params) / params < 0.01, (name, counted)
    assert MODELS[name].source.startswith("https://huggingface.co/")


def test_disk_delta_readers_apply_what_plan_chain_plans():
    planner = ScalePlanner("qwen3_moe", hf_config(ModelSpec(**MOE_SPEC)), TrainerLayout(pp=2, ep=2, dp=2),
                           FleetLayout(engines=2, tp=2))
    steady = planner.plan("disk_delta", bucket_bytes=1 << 20)
    behind = planner.plan("disk_delta", bucket_bytes=1 << 20, versions_behind=3)
    assert steady.extra["chain"] == [(11, "delta")]
    assert behind.extra["chain"] == [(11, "delta"), (12, "delta"), (13, "delta")]
    assert behind.receivers[0].bytes == 3 * steady.receivers[0].bytes
