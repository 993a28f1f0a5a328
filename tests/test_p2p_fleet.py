"""A fleet over P2P: three reference engines of one layout, each its own launched job, behind a Megatron
trainer of TP=2 writing with NIXL over UCX's TCP transport; a fourth engine joins the running fleet.

The engines are chained (0 -> 1 -> 2): the trainer writes only engine 0, which forwards every round to
engine 1, which forwards to engine 2. Version 1: every engine commits and the trainer's bytes are one
model. Version 2: engine 0 dies right after forwarding its first round; engines 1 and 2 abort (they keep
version 1), then commit version 2 from the trainer in the next wave. Version 3: engine 3, started after
version 2, was admitted meanwhile and commits version 3. Every commit of every engine equals the trainer's
tensors bit for bit, and the engine's logits equal the trainer's Megatron forward.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.dist import free_port, run_ranks
from tests.support.fleet_jobs import KILLED, fleet_engine_job, fleet_trainer_job
from tests.test_fleet_jobs import _check_exact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TIMEOUT = 400.0
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def _model_bytes(case: dict) -> int:
    import torch

    from megatron_sync.convert import get_converter
    from tests.support.models import ModelSpec, hf_config

    specs = get_converter(case["spec"]["family"], hf_config(ModelSpec(**case["spec"])),
                          dtype=torch.float32).tensor_specs()  # the jobs sync in float32
    return sum(s.nbytes for s in specs)


@pytest.mark.parametrize("staging_sets", ["auto", 1])
def test_a_p2p_fleet_chains_engines_recovers_from_a_dead_forwarder_and_takes_a_new_engine(staging_sets):
    """With two staging sets (what `auto` gives the reference engine) and with one (what it gives vLLM): each
    chained engine then posts where its only set starts once its host copy of the live version is taken, and
    the engine before it waits for that before forwarding into it."""
    case = {"port": free_port(), "engines": 3, "engine_tp": 1, "layout": {"tp": 2}, "versions": 3,
            "spec": {"family": "qwen3"}, "timeout_s": 15.0, "env": UCX_TCP, "await": {3: {3: 0}},
            "weight_sync": {"fleet": True, "transport": "p2p", "p2p_backend": "nixl", "bucket_size_mb": 0.02,
                            "staging_sets": staging_sets}}

    def engine(engine_id: int, **fault):
        return run_ranks(fleet_engine_job, 1, {**case, "engine_id": engine_id, **fault}, timeout=TIMEOUT)

    with ThreadPoolExecutor(max_workers=5) as pool:
        trainer = pool.submit(run_ranks, fleet_trainer_job, 2, case, timeout=TIMEOUT)
        first = {0: pool.submit(engine, 0, die_forwarding=2), 1: pool.submit(engine, 1), 2: pool.submit(engine, 2)}
        killed = first[0].result()  # ends when it dies forwarding version 2; then a new engine joins
        late = pool.submit(engine, 3)
        trainers, one, two, three = trainer.result(), first[1].result(), first[2].result(), late.result()

    assert all(status == "ok" for status, _ in trainers.values()), trainers
    leader = trainers[0][1]
    assert killed == {0: ("exited", KILLED)}
    # engines 1 and 2: version 2 aborted once (they still held version 1 exactly), then committed
    assert _check_exact(one, leader, case["spec"]) == [1, 1, 2, 3]
    assert _check_exact(two, leader, case["spec"]) == [1, 1, 2, 3]
    assert _check_exact(three, leader, case["spec"]) == [3]  # joined the running fleet: the current version
    sets = {h["staging_sets"] for out in (one, two, three) for h in out[0][1]["held"]}
    assert sets == {2 if staging_sets == "auto" else 1}

    rows = [{r["engine"]: r for r in version if "outcome" in r} for version in leader["fleet"]]
    model = _model_bytes(case)
    # version 1: engine 0 from the trainer, 1 and 2 forwarded; the trainer's bytes are one model
    assert {e: (r["source"], r["outcome"]) for e, r in rows[0].items()} == {
        0: ("trainer", "committed"), 1: ("engine 0", "committed"), 2: ("engine 1", "committed")}
    assert sum(r["trainer_bytes"] for r in rows[0].values()) == model
    # version 2: the forwarder died; the engines behind it commit from the trainer in a later wave
    v2 = [r for r in leader["fleet"][1] if "outcome" in r]
    assert any(r["engine"] == 0 and r["outcome"] == "failed" for r in v2), v2
    for e in (1, 2):
        mine = [(r["source"], r["outcome"]) for r in v2 if r["engine"] == e]
        assert mine[-1] == ("trainer", "committed") and ("aborted" in {o for _, o in mine}), (e, mine)
    # version 3: engines 1, 2 and the new engine 3 chained; one model out of the trainer
    assert {e: r["outcome"] for e, r in rows[2].items()} == {1: "committed", 2: "committed", 3: "committed"}
    assert sum(r["trainer_bytes"] for r in rows[2].values()) == model
