"""`transport: auto`: the choice is the time model's fastest candidate, an unknown hardware profile is refused,
the inference job adopts the trainer's choice through the session, and the whole thing runs end to end."""

from __future__ import annotations

import pytest

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.scale.auto import adopt_host_choice, choose, exclusions, resolve
from megatron_sync.scale.hardware import profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import predict
from megatron_sync.session.rendezvous import Identity, disagreements, expectations

# (what it declares, trainer, engines, SGLang engines, the transport the model must pick)
DECLARED = [
    ("8 trainer GPUs, 4 engines of 8: every engine rank needs a quarter of what broadcast sends it",
     TrainerLayout(tp=2, dp=4, ep=8), FleetLayout(engines=4, tp=8, expert_parallel=True), False, "broadcast"),
    ("64 trainer GPUs, one engine of 32 with EP: each rank needs 1/32 of the model, sent by 64 ranks",
     TrainerLayout(tp=2, dp=32, ep=8), FleetLayout(engines=1, tp=32, expert_parallel=True), False, "p2p"),
    ("the same layouts with SGLang engines: p2p cannot write into them",
     TrainerLayout(tp=2, dp=32, ep=8), FleetLayout(engines=1, tp=32, expert_parallel=True), True, "broadcast"),
]


@pytest.mark.parametrize("what,trainer,fleet,sglang,expected", DECLARED, ids=["broadcast", "p2p", "sglang"])
def test_auto_picks_the_fastest_prediction_on_three_declared_cases(what, trainer, fleet, sglang, expected):
    """Moonlight-16B-A3B on H100 nodes: the choice is the candidate whose prediction (recomputed here with
    the time model, independently of `choose`) is smallest; the three cases pick what is declared."""
    family, config = model_named("moonlight-16b-a3b")
    planner = ScalePlanner(family, config, trainer, fleet)
    profile = profile_named("h100")
    choice = choose(planner, profile, excluded=exclusions(sglang_engines=sglang))
    runnable = [c for c in choice.candidates if c.seconds is not None]
    for c in runnable:
        again = predict(planner.plan(c.transport, bucket_bytes=int(c.bucket_size_mb * 2**20)), profile)
        assert again.seconds == pytest.approx(c.seconds)
    fastest = min(runnable, key=lambda c: (c.seconds, c.bucket_size_mb))
    assert (choice.transport, choice.bucket_size_mb) == (fastest.transport, fastest.bucket_size_mb)
    assert choice.transport == expected, choice.describe()
    assert {c.transport for c in runnable} == ({"broadcast"} if sglang else {"broadcast", "p2p"})


def test_sglang_engines_and_file_transports_are_not_candidates():
    assert set(exclusions(sglang_engines=True)) == {"p2p", "disk_delta"}
    assert set(exclusions(sglang_engines=False)) == {"disk_delta"}


def test_an_unknown_hardware_profile_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"hardware_profile='h1000' is not valid; use one of \[.*'h100'.*'local'"):
        WeightSyncConfig(transport="auto", hardware_profile="h1000")
    with pytest.raises(ValueError, match="unknown hardware profile 'a100'.*h200"):
        profile_named("a100")
    assert WeightSyncConfig(transport="auto", hardware_profile="gb200").transport == "auto"


def test_a_trainer_with_auto_needs_a_hardware_profile():
    config = WeightSyncConfig(transport="auto", family="deepseek_v3")
    family, hf = model_named("moonlight-16b-a3b")
    with pytest.raises(ValueError, match="transport 'auto' needs weight_sync.hardware_profile"):
        resolve(config, TrainerLayout(), family, hf)


def test_an_inference_job_with_auto_adopts_the_trainers_choice_at_the_rendezvous():
    trainer = WeightSyncConfig(transport="p2p", bucket_size_mb=512.0, family="qwen3")  # resolved by the trainer
    host = Identity(job="t", role="trainer", member=0,
                    expects=expectations(trainer, trainer_stages=1, backend="gloo"))
    joiner_auto = Identity(job="i", role="inference", member=0,
                           expects=expectations(WeightSyncConfig(transport="auto", family="qwen3"), trainer_stages=1,
                                                backend="gloo"))
    joiner_fixed = Identity(job="i", role="inference", member=0,
                            expects=expectations(WeightSyncConfig(family="qwen3"), trainer_stages=1, backend="gloo"))
    assert disagreements(host, joiner_auto) == []
    refused = disagreements(host, joiner_fixed)
    assert any("transport 'p2p', this inference job uses 'broadcast'" in r for r in refused)
    adopted = adopt_host_choice(WeightSyncConfig(transport="auto", family="qwen3"), dict(host.expects))
    assert (adopted.transport, adopted.bucket_size_mb) == ("p2p", 512.0)
    with pytest.raises(ValueError, match="did not announce a resolved transport"):
        adopt_host_choice(adopted, dict(joiner_auto.expects))


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_transport_auto_end_to_end_on_this_machine():
    """Both jobs say `transport: auto` with this machine's measured profile: the trainer resolves it (the
    profile models broadcast here), the engines adopt the same transport and bucket size from the session,
    and every engine shard equals its slice of what the trainer sent, for two versions."""
    from tests.support.jobs import run_pair, shards_not_sent

    case = {"spec": {"family": "qwen3"}, "layout": {"tp": 2}, "versions": 2, "engines": 1, "engine_tp": 2,
            "weight_sync": {"transport": "auto", "hardware_profile": "local"}}
    trainers, engines = run_pair(case, timeout=360)
    chosen = {(r["transport"], r["bucket_size_mb"]) for r in trainers + engines}
    assert len(chosen) == 1 and next(iter(chosen))[0] == "broadcast", chosen
    assert all([h["version"] for h in engine["held"]] == [1, 2] for engine in engines)
    assert shards_not_sent(engines, trainers[0]["sent"], case["spec"]) == []
