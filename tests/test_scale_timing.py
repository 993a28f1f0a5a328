"""The time model's structure: each transport's time moves with what it really depends on, every profile's
numbers carry a source, and this machine's profile models only what its rates file measured."""

from __future__ import annotations

import functools

import pytest

from megatron_sync.scale.hardware import PROFILES, local_profile, profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import SyncOptions, missing_rates, models, predict
from tests.support.models import ModelSpec, hf_config

GIB = 1 << 30


@functools.lru_cache(maxsize=None)
def _moonlight(engines: int) -> ScalePlanner:
    family, config = model_named("moonlight-16b-a3b")
    return ScalePlanner(family, config, TrainerLayout(tp=2, dp=32, ep=8), FleetLayout(engines=engines, tp=16,
                                                                                          expert_parallel=True))


def test_more_engines_cost_broadcast_latency_and_p2p_one_round_each_not_bytes():
    """Broadcast sends every byte to every engine rank at once, so more engines of the same size cost it only
    the per-bucket latency of a longer chain; P2P's trainer writes one copy whatever the number of engines
    (they forward), so each more engine costs one round of its chain, not its shard's bytes again."""
    h100 = profile_named("h100")
    one, four = _moonlight(1), _moonlight(4)
    b1, b4 = (predict(p.plan("broadcast", bucket_bytes=GIB), h100).seconds for p in (one, four))
    assert b1 < b4 < 1.01 * b1
    p1, p4 = (p.plan("p2p", bucket_bytes=64 << 20) for p in (one, four))
    assert p1.extra["egress"] == p4.extra["egress"]
    t1, t4 = predict(p1, h100), predict(p4, h100)
    round_s = 4 * (64 << 20) / h100.nic_per_gpu + h100.message_s.value
    assert t4.seconds - t1.seconds == pytest.approx(3 * round_s, rel=1e-6)


def test_checksums_cost_broadcast_device_time():
    planner, h100 = _moonlight(2), profile_named("h100")
    summary = planner.plan("broadcast", bucket_bytes=GIB)
    assert predict(summary, h100, SyncOptions(checksum=False)).seconds < predict(summary, h100).seconds


def test_an_engine_that_copies_its_staged_version_pays_the_copy_one_that_runs_on_it_switches():
    """Broadcast, ipc and P2P stage a version in a set: an engine that copies it into its own weights (the default,
    as vLLM and SGLang do) pays a device copy of its largest shard; one that computes on the set switches."""
    planner, h100 = _moonlight(2), profile_named("h100")
    for transport in ("broadcast", "p2p"):
        summary = planner.plan(transport, bucket_bytes=GIB)
        copies, switches = predict(summary, h100), predict(summary, h100, SyncOptions(engine_switch=True))
        shard = max(summary.shard_bytes)
        assert copies.phase("apply") >= shard / h100.device_copy > 0 and switches.phase("apply") == 0.0
        assert switches.phase("apply (switch staging set)") == h100.switch_s.value
        assert copies.seconds - switches.seconds == pytest.approx(copies.phase("apply") - h100.switch_s.value)


def test_one_staging_set_copies_and_each_engine_rank_holds_weights_plus_one_set_and_a_host_copy():
    """With `staging_sets: 1` an engine copies even if it could run on a set (the set takes the next version), and
    the prediction says what each engine rank holds: 2 x its largest shard on the GPU instead of 3 x (or 2 x
    running on a set), plus the host copy and its time between syncs, which no sync counts. `staging_sets: auto`
    (the default) is one set for an engine that copies, two for one that runs on a set."""
    planner, h100 = _moonlight(2), profile_named("h100")
    summary = planner.plan("p2p", bucket_bytes=GIB)
    one = predict(summary, h100, SyncOptions(staging_sets=1, engine_switch=True))
    two_copying = predict(summary, h100, SyncOptions(staging_sets=2))
    two_switching = predict(summary, h100, SyncOptions(engine_switch=True))  # "auto": 2 for an engine on its set
    assert predict(summary, h100).notes == one.notes  # "auto": 1 for an engine that copies
    assert one.seconds == pytest.approx(two_copying.seconds) and one.phase("apply") > 0
    shard = max(summary.shard_bytes) / 1e9
    held = {p: p.notes[0].split(" = ")[-1] for p in (one, two_copying, two_switching)}
    assert held[one].startswith(f"{2 * shard:.1f} GB on the GPU, and a host copy of the live version ({shard:.1f} GB")
    assert f"copied in {max(summary.shard_bytes) / h100.pcie.value:.2f} s between syncs" in one.notes[0]
    assert held[two_copying].startswith(f"{3 * shard:.1f} GB")
    assert held[two_switching] == f"{2 * shard:.1f} GB on the GPU"
    assert predict(planner.plan("disk_delta", bucket_bytes=GIB), h100).notes == ()


def test_every_profile_number_has_a_source():
    for profile in PROFILES.values():
        rows = profile.table()
        assert rows and all(source and source != "n/a" for field, _, source in rows if field != "cores"), profile.name


def test_every_p2p_phase_names_its_rate_and_source():
    p = predict(_moonlight(2).plan("p2p", bucket_bytes=GIB), profile_named("h100"))
    assert all(phase.rate and "[" in phase.rate for phase in p.phases), [ph for ph in p.phases if not ph.rate]


def test_this_machines_profile_predicts_the_bench_topology():
    """The measured rates (megatron_sync/scale/rates_local.json) cover every term of the CPU-bound broadcast."""
    spec = ModelSpec(family="qwen3_moe", num_experts=8)
    planner = ScalePlanner("qwen3_moe", hf_config(spec), TrainerLayout(ep=2, dp=2),
                           FleetLayout(engines=1, tp=2, vocab_parallel=False))
    p = predict(planner.plan("broadcast", bucket_bytes=GIB), local_profile())
    assert p.seconds > 0 and p.cpu_seconds > 0 and "cores" in " ".join(ph.where for ph in p.phases)


def test_this_machine_models_only_what_its_rates_file_measured():
    """A rates file without a transport's rates leaves that transport unmodelled, naming what to measure."""
    local = local_profile()
    lacking = {k: v for k, v in local.cpu.items() if not k.startswith(("wsum64", "send_nixl", "sync_fixed_s_p2p"))}
    stripped = type(local)(**{**local.__dict__, "cpu": lacking})
    options = SyncOptions(p2p_backend="nixl")
    assert not models("p2p", stripped, 1, options)
    assert "wsum64_byte" in missing_rates("p2p", stripped, 1, options)
    planner = ScalePlanner("qwen3_moe", hf_config(ModelSpec(family="qwen3_moe", num_experts=8)),
                           TrainerLayout(ep=2, dp=2), FleetLayout(engines=1, tp=2, vocab_parallel=False))
    with pytest.raises(ValueError, match="lacks .*wsum64_byte.*bench_scale_rates.py"):
        predict(planner.plan("p2p", bucket_bytes=GIB), stripped, options)
