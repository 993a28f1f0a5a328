"""The time model's structure: no transport beats the physical bound, each transport's time moves with
what it really depends on, and every profile's numbers carry a source."""

from __future__ import annotations

import pytest

from megatron_sync.scale.hardware import PROFILES, local_profile, profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import SyncOptions, predict
from tests.support.models import ModelSpec, hf_config

GIB = 1 << 30


def _moonlight(engines: int) -> ScalePlanner:
    family, config = model_named("moonlight-16b-a3b")
    return ScalePlanner(family, config, TrainerLayout(tp=2, dp=32, ep=8), FleetLayout(engines=engines, tp=16,
                                                                                          expert_parallel=True))


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_no_transport_beats_the_physical_bound(profile):
    planner = _moonlight(2)
    for transport in ("broadcast", "p2p", "disk_delta"):
        p = predict(planner.plan(transport, bucket_bytes=GIB), profile_named(profile))
        assert p.seconds >= p.physical_bound > 0, (transport, p)


def test_more_engines_cost_p2p_bytes_but_not_broadcast():
    """Broadcast sends every byte to every engine rank at once (one NIC each), so more engines of the same
    size leave its time unchanged but for the per-bucket latency of a longer chain; P2P's senders send every
    engine its own copy, so theirs grows."""
    h100 = profile_named("h100")
    one, four = _moonlight(1), _moonlight(4)
    b1, b4 = (predict(p.plan("broadcast", bucket_bytes=GIB), h100).seconds for p in (one, four))
    p1, p4 = (predict(p.plan("p2p", bucket_bytes=GIB), h100).seconds for p in (one, four))
    assert b1 < b4 < 1.01 * b1
    assert p4 > 1.5 * p1


def test_checksums_cost_p2p_host_time():
    planner, h100 = _moonlight(2), profile_named("h100")
    summary = planner.plan("p2p", bucket_bytes=GIB)
    assert predict(summary, h100, SyncOptions(checksum=False)).seconds < predict(summary, h100).seconds


def test_every_profile_number_has_a_source():
    for profile in PROFILES.values():
        rows = profile.table()
        assert rows and all(source and source != "n/a" for field, _, source in rows if field != "cores"), profile.name


def test_this_machines_profile_predicts_the_bench_topology():
    """The measured rates (megatron_sync/scale/rates_local.json) cover every term of the CPU-bound model."""
    spec = ModelSpec(family="qwen3_moe", num_experts=8)
    planner = ScalePlanner("qwen3_moe", hf_config(spec), TrainerLayout(ep=2, dp=2),
                           FleetLayout(engines=1, tp=2, vocab_parallel=False))
    p = predict(planner.plan("broadcast", bucket_bytes=GIB), local_profile())
    assert p.seconds > 0 and p.cpu_seconds > 0 and "cores" in " ".join(ph.where for ph in p.phases)
