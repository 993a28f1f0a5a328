"""`transport: auto`: the choice is the time model's fastest candidate, ipc is a candidate exactly when the jobs
are colocated on one host, SGLang engines leave p2p and ipc out, an unknown hardware profile is refused, the
inference job adopts the trainer's choice through the session, `python -m megatron_sync.scale auto` prints the
choice and its reason, and the whole thing runs end to end."""

from __future__ import annotations

import functools

import pytest

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.scale.__main__ import main
from megatron_sync.scale.auto import Choice, adopt_host_choice, choose, exclusions, resolve
from megatron_sync.scale.hardware import profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import predict
from megatron_sync.session.rendezvous import Identity, disagreements, expectations

# (what it declares, trainer, engines, SGLang engines, the transports that must be candidates)
SETUPS = [
    ("colocated on one node: 8 GPUs train, then serve as one engine of TP=8",
     TrainerLayout(tp=2, dp=4, ep=8), FleetLayout(engines=1, tp=8, colocated=True), False,
     {"broadcast", "p2p", "ipc"}),
    ("2 + 2 nodes: 16 trainer GPUs, 2 engines of TP=8 with EP on 2 nodes of their own",
     TrainerLayout(tp=2, dp=8, ep=8), FleetLayout(engines=2, tp=8, expert_parallel=True), False,
     {"broadcast", "p2p"}),
    ("the same with SGLang engines: p2p and ipc cannot write into them",
     TrainerLayout(tp=2, dp=8, ep=8), FleetLayout(engines=2, tp=8, expert_parallel=True), True, {"broadcast"}),
]


@functools.lru_cache(maxsize=None)
def _planner(trainer: TrainerLayout, fleet: FleetLayout) -> ScalePlanner:
    family, config = model_named("moonlight-16b-a3b")
    return ScalePlanner(family, config, trainer, fleet)


@pytest.mark.parametrize("what,trainer,fleet,sglang,runnable", SETUPS, ids=["colocated", "2+2", "sglang"])
def test_auto_picks_the_fastest_prediction_among_the_transports_that_can_run(what, trainer, fleet, sglang,
                                                                               runnable):
    """Moonlight-16B-A3B on H100 nodes: the choice is the candidate whose prediction (recomputed here with
    the time model, independently of `choose`) is smallest, among exactly the transports that can run."""
    planner, profile = _planner(trainer, fleet), profile_named("h100")
    choice = choose(planner, profile, excluded=exclusions(sglang_engines=sglang, trainer=trainer, fleet=fleet))
    candidates = [c for c in choice.candidates if c.seconds is not None]
    for c in candidates:
        again = predict(planner.plan(c.transport, bucket_bytes=int(c.bucket_size_mb * 2**20)), profile)
        assert again.seconds == pytest.approx(c.seconds)
    fastest = min(candidates, key=lambda c: (c.seconds, c.bucket_size_mb))
    assert (choice.transport, choice.bucket_size_mb) == (fastest.transport, fastest.bucket_size_mb)
    assert {c.transport for c in candidates} == runnable, choice.describe()
    assert choice.reason.startswith(("fastest predicted", "the only transport"))


def test_sglang_engines_and_file_transports_are_not_candidates():
    assert set(exclusions(sglang_engines=True)) == {"p2p", "ipc", "disk_delta"}
    colocated = exclusions(sglang_engines=False, trainer=TrainerLayout(tp=8), fleet=FleetLayout(tp=8, colocated=True))
    assert set(colocated) == {"disk_delta"}
    apart = exclusions(sglang_engines=False, trainer=TrainerLayout(tp=8), fleet=FleetLayout(tp=8))
    assert set(apart) == {"disk_delta", "ipc"} and "GPUs of their own" in apart["ipc"]


def test_after_a_sync_the_measured_time_is_logged_beside_the_prediction_with_the_ratio():
    choice = Choice("p2p", 64.0, 0.5, "receive", "h100", ())
    assert choice.measured(3, 0.6) == ("version 3: synced in 0.600 s measured; the scale model predicted 0.500 s "
                                       "(measured / predicted = 1.20; transport auto: p2p, 64 MiB buckets, "
                                       "profile h100)")


def test_the_auto_command_prints_every_candidate_the_choice_and_its_reason(capsys, tmp_path):
    """Flags, or a job YAML (trainer: / weight_sync: / colocated:), give the same layouts."""
    job = tmp_path / "train.yaml"
    job.write_text("colocated: true\ntrainer: {tp: 2, dp: 4, ep: 8}\n"
                   "weight_sync: {hardware_profile: h100, num_inference_ranks: 8, engine_tp_size: 8}\n")
    main(["auto", "--model", "moonlight-16b-a3b", "--config", str(job)])
    from_yaml = capsys.readouterr().out
    main(["auto", "--model", "moonlight-16b-a3b", "--trainer", "tp=2,dp=4,ep=8", "--fleet",
          "engines=1,tp=8,whole_vocab,colocated"])
    from_flags = capsys.readouterr().out

    def without_timing(out: str) -> list[str]:
        return [line for line in out.splitlines() if "planner setup" not in line]

    assert without_timing(from_yaml) == without_timing(from_flags)
    assert "colocated on the trainer's GPUs" in from_yaml
    assert [line.split()[0] for line in from_yaml.splitlines() if line.strip().startswith("ipc ")] == ["ipc"] * 3
    choice = next(line for line in from_yaml.splitlines() if line.startswith("choice: transport "))
    reason = next(line for line in from_yaml.splitlines() if line.startswith("reason: "))
    assert choice and ("fastest predicted" in reason)


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
    profile models what its rates file measured) as `resolve` does here, the engines adopt the same
    transport and bucket size from the session, and every engine shard equals its slice of what the trainer
    sent, for two versions."""
    from tests.support.jobs import case_hf_config, run_pair, shards_not_sent, sync_config

    case = {"spec": {"family": "qwen3"}, "layout": {"tp": 2}, "versions": 2, "engines": 1, "engine_tp": 2,
            "weight_sync": {"transport": "auto", "hardware_profile": "local"}}
    expected = resolve(sync_config({**case, "port": 1}), TrainerLayout(tp=2), "qwen3", case_hf_config(case))
    trainers, engines = run_pair(case, timeout=360)
    chosen = {(r["transport"], r["bucket_size_mb"]) for r in trainers + engines}
    assert chosen == {(expected.transport, expected.bucket_size_mb)}, (chosen, expected.describe())
    assert all([h["version"] for h in engine["held"]] == [1, 2] for engine in engines)
    assert shards_not_sent(engines, trainers[0]["sent"], case["spec"]) == []
