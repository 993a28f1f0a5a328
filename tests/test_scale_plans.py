"""The scale model's plans: the project's planners on metadata, at mid size against the full planners and
against megatron-core's own parameters, and at full size (Kimi-K2, 1T) on meta tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_sync.transports.p2p.assign import assign_replica
from megatron_sync.transports.p2p.replica import replica_units
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import MODELS, converter_for, model_named
from megatron_sync.scale.megatron_side import stage_units
from megatron_sync.scale.plans import ScalePlanner, assign_balanced
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


# ---------------------------------------------------------------- fast paths equal the full planners


CASES = [
    (TrainerLayout(tp=2, pp=2, dp=2, ep=2, gpus_per_node=4), FleetLayout(engines=3, tp=2)),
    (TrainerLayout(tp=2, pp=2, dp=2, ep=2, gpus_per_node=4), FleetLayout(engines=2, tp=4, expert_parallel=True)),
    (TrainerLayout(tp=1, pp=1, dp=4, ep=4, gpus_per_node=2), FleetLayout(engines=2, tp=4, vocab_parallel=False)),
]


def _totals(endpoints):
    return [(e.rank, e.node, e.bytes, e.tensors, e.messages, e.largest, e.peers) for e in endpoints]


@pytest.mark.parametrize("trainer,fleet", CASES, ids=["tp-engines", "ep-engines", "whole-vocab"])
@pytest.mark.parametrize("bucket", [1000, 1 << 16, 1 << 30])
def test_p2p_fast_totals_equal_the_full_transfer_plan(trainer, fleet, bucket):
    """Per sender and per receiver (bytes, ranges, messages, largest range, peers), the summary computed
    once per engine and tensor kind equals the full `build_transfer_plan` over every engine's receivers."""
    planner = ScalePlanner("qwen3_moe", hf_config(ModelSpec(**MOE_SPEC)), trainer, fleet)
    fast = planner.plan("p2p", bucket_bytes=bucket, fast=True)
    full = planner.plan("p2p", bucket_bytes=bucket, fast=False)
    assert _totals(fast.senders) == _totals(full.senders)
    assert _totals(fast.receivers) == _totals(full.receivers)
    assert fast.extra == full.extra and fast.shard_bytes == full.shard_bytes
    assert sum(e.bytes for e in full.senders) == sum(e.bytes for e in full.receivers) > 0


def test_p2p_fast_totals_equal_the_full_plan_for_an_fp8_mla_model():
    spec = ModelSpec(family="deepseek_v3", hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                     qk_rope_head_dim=32, v_head_dim=32, num_heads=4, ffn_hidden_size=256, moe_ffn_hidden_size=128)
    config = hf_config(spec).to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    planner = ScalePlanner("deepseek_v3", config, TrainerLayout(tp=2, ep=2), FleetLayout(engines=2, tp=2))
    fast, full = (planner.plan("p2p", bucket_bytes=1 << 14, fast=f) for f in (True, False))
    assert _totals(fast.senders) == _totals(full.senders) and _totals(fast.receivers) == _totals(full.receivers)
    assert any(name.endswith("weight_scale_inv") for name in (s.name for s in planner.specs))


@pytest.mark.parametrize("trainer", [CASES[0][0], CASES[2][0], TrainerLayout(tp=2, pp=2, ep=4, dp=4)])
def test_assign_balanced_chooses_what_assign_replica_chooses(trainer):
    converter = converter_for("qwen3_moe", hf_config(ModelSpec(**MOE_SPEC)))
    units = [u for stage, us in enumerate(stage_units(converter, trainer, torch.bfloat16))
             for u in replica_units(us, converter, stage)]
    for cost in (None, {h: 3 * n + 1 for u in units for h, n in u.hf}):
        fast = assign_balanced(units, trainer.ranks(), cost=cost)
        full = assign_replica(units, trainer.ranks(), cost=cost)
        assert fast.holders == full.holders


# ---------------------------------------------------------------- full scale on metadata


@pytest.mark.timeout(600)
def test_kimi_k2_one_trillion_parameters_plans_on_metadata():
    """Kimi-K2 (1.03 TB in FP8 with [64, 64] blocks, 139,583 HF tensors) from 32 trainer nodes (TP=8 PP=8
    CP=4 EP=32) into 32 inference nodes (8 engines of TP=32 with EP): every planner runs on meta tensors;
    the plans cover the checkpoint and conserve bytes. `pytest --durations` shows what it costs."""
    family, config = model_named("kimi-k2")
    config = copy.deepcopy(config)
    config["quantization_config"]["weight_block_size"] = [64, 64]
    planner = ScalePlanner(family, config, TrainerLayout(tp=8, pp=8, cp=4, ep=32),
                           FleetLayout(engines=8, tp=32, expert_parallel=True))
    assert len(planner.specs) == 139_583 and planner.model_bytes == 1_030_253_466_304
    broadcast = planner.plan("broadcast", bucket_bytes=1 << 30)
    assert len(broadcast.senders) == 8 and sum(s.bytes for s in broadcast.senders) == planner.model_bytes
    assert all(r.bytes == planner.model_bytes for r in broadcast.receivers) and len(broadcast.receivers) == 256
    p2p = planner.plan("p2p", bucket_bytes=1 << 30)
    assert sum(s.bytes for s in p2p.senders) == sum(r.bytes for r in p2p.receivers) == 8 * sum(p2p.shard_bytes[:32])
    assert [r.bytes for r in p2p.receivers] == p2p.shard_bytes
    assert sum(p2p.shard_bytes[:32]) >= planner.model_bytes  # one engine holds the model (norms on every rank)
    delta = planner.plan("disk_delta", bucket_bytes=1 << 30)
    assert delta.extra["chain"] == [(11, "delta")] and len(delta.receivers) == 32


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
