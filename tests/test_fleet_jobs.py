"""A fleet of three reference engines, each its own launched job, behind a Megatron trainer of TP=2.

Engine 0 is killed between syncs (every rank exits right after committing version 2), engine 1 mid-sync
(one of its two ranks exits a few tensors into version 3). Training goes on through both; each killed
engine is restarted as soon as its job ended and rejoins at the next sync. Every version any engine
commits is checked against what the trainer sent (shards, bit for bit) and against the trainer's own
Megatron forward (logits); engine 2 commits every version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support.dist import free_port, run_ranks
from tests.support.fakes import shard_of
from tests.support.fleet_jobs import KILLED, fleet_engine_job, fleet_trainer_job
from tests.support.models import ModelSpec, hf_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TIMEOUT = 400.0


def _check_exact(engine_ranks: dict, trainer: dict, spec: dict) -> list[int]:
    """Assert every version an engine's ranks committed is the trainer's, shards and logits; return the versions."""
    from megatron_sync.engines.reference.engine import ReferenceEngine

    config = hf_config(ModelSpec(**spec))
    versions = None
    for tp_rank, (status, out) in sorted(engine_ranks.items()):
        assert status == "ok", out
        slicer = ReferenceEngine(config, tp_rank=tp_rank, tp_size=len(engine_ranks))
        mine = []
        for held in out["held"]:
            v = held["version"]
            mine.append(v)
            for name, shard in held["shards"].items():
                assert torch.equal(shard, shard_of(slicer, name, trainer["sent"][v - 1][name])), (v, tp_rank, name)
            assert torch.allclose(held["logits"], trainer["logits"][v - 1], atol=1e-4), v
        assert versions is None or mine == versions  # the engine's ranks committed the same versions
        versions = mine
    return versions


def test_a_fleet_keeps_training_through_an_engine_killed_between_syncs_and_one_mid_sync():
    case = {"port": free_port(), "engines": 3, "engine_tp": 2, "layout": {"tp": 2}, "versions": 5,
            "spec": {"family": "qwen3"}, "timeout_s": 30.0, "weight_sync": {"fleet": True},
            "await": {4: {0: 1}, 5: {1: 1}}}
    faults = {0: {"die_after": 2}, 1: {"die_during": (3, 1)}, 2: {}}

    def engine(engine_id: int, **fault):
        return run_ranks(fleet_engine_job, 2, {**case, "engine_id": engine_id, **fault}, timeout=TIMEOUT)

    with ThreadPoolExecutor(max_workers=6) as pool:
        trainer = pool.submit(run_ranks, fleet_trainer_job, 2, case, timeout=TIMEOUT)
        first = {e: pool.submit(engine, e, **faults[e]) for e in range(3)}
        killed0 = first[0].result()  # ends when it is killed after version 2: restart it
        restarted0 = pool.submit(engine, 0)
        killed1 = first[1].result()  # ends once killed mid-version 3 (its surviving rank fails): restart it
        restarted1 = pool.submit(engine, 1)
        trainers, survivor, rejoined0, rejoined1 = (trainer.result(), first[2].result(), restarted0.result(),
                                                    restarted1.result())

    assert all(status == "ok" for status, _ in trainers.values()), trainers
    leader = trainers[0][1]
    assert len(leader["sent"]) == 5  # training and syncing went on through both kills

    # engine 2 saw everything; engine 0 died after 2 and, restarted, serves from 4 on (admitted before 4)
    assert _check_exact(survivor, leader, case["spec"]) == [1, 2, 3, 4, 5]
    assert killed0 == {0: ("exited", KILLED), 1: ("exited", KILLED)}
    first_versions = rejoined0[0][1]["held"][0]["version"]
    assert first_versions in (3, 4) and _check_exact(rejoined0, leader, case["spec"])[-1] == 5
    assert rejoined0[0][1]["generation"] == 1

    # engine 1: rank 1 killed mid-3, rank 0 fails that sync and keeps version 2; restarted, it serves 5
    assert killed1[1] == ("exited", KILLED)
    status, out = killed1[0]
    assert status == "ok" and out["failure"] is not None and out["failure"]["version"] == 2, killed1
    assert [h["version"] for h in out["held"]] == [1, 2]
    config = hf_config(ModelSpec(**case["spec"]))
    from megatron_sync.engines.reference.engine import ReferenceEngine
    slicer = ReferenceEngine(config, tp_rank=0, tp_size=2)
    assert all(torch.equal(shard, shard_of(slicer, name, leader["sent"][1][name]))
               for name, shard in out["failure"]["shards"].items())  # still exactly version 2
    assert _check_exact(rejoined1, leader, case["spec"])[-1] == 5
    assert rejoined1[0][1]["generation"] == 1

    # the trainer's rows: who committed each version, and the membership events
    rows = leader["fleet"]
    committed = [{r["engine"] for r in version if r.get("outcome") == "committed"} for version in rows]
    assert committed[0] == committed[1] == {0, 1, 2}
    assert 1 not in committed[2] and {2} <= committed[2]
    assert committed[3] >= {0, 2} and committed[4] == {0, 1, 2}
    events = [r for version in rows for r in version if "event" in r]
    assert any(r["event"] == "rejoined" and r["engine"] == 0 for r in events), events
    assert any(r["event"] == "rejoined" and r["engine"] == 1 for r in events), events
