"""The two agreement rounds every transport's receivers run (`transport/commit.py`), on two inference
ranks in one process: each rank is a thread with its own reference engine, agreeing over a barrier."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import torch

from megatron_sync.core.agreement import failures_of
from megatron_sync.engines.reference.engine import ReferenceEngine
from megatron_sync.core.errors import SyncAbortedError
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.session.commit import AgreedCommit
from tests.support.models import ModelSpec, hf_config

RANKS = 2


class Rounds:
    """One agreement round at a time among RANKS threads: each posts its error, all see every error."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(RANKS, timeout=30)
        self.posted: list[Optional[str]] = [None] * RANKS

    def agree_as(self, rank: int):
        def agree(version: int, error: Optional[str]) -> None:
            self.posted[rank] = error
            self.barrier.wait()
            failures = failures_of(list(self.posted))
            self.barrier.wait()  # every rank has read this round before the next one posts
            if failures:
                raise SyncAbortedError(version, failures)
        return agree


def _engine() -> ReferenceEngine:
    return ReferenceEngine(hf_config(ModelSpec("qwen3")), tp_rank=0, tp_size=1, group=None, dtype=torch.float32)


def _next_version(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    return {name: t + 1 for name, t in engine.snapshot().items()}


def _run(commits: list[AgreedCommit], staged: list[dict], *, as_version: Optional[int] = None,
         errors: tuple[Optional[str], ...] = (None,) * RANKS) -> list:
    def one(rank: int):
        try:
            commits[rank].load_agreed(2, staged[rank], SyncMetrics(2, role="receiver", rank=rank),
                                      as_version=as_version, error=errors[rank])
        except SyncAbortedError as e:
            return e
        return None
    with ThreadPoolExecutor(RANKS) as pool:
        return list(pool.map(one, range(RANKS)))


def _failing_commit(engine: ReferenceEngine):
    def commit(shards, version):
        engine.load_shards(shards, version)  # loads, then fails: the engine must be put back by its caller
        raise RuntimeError("device lost halfway")
    return commit


def test_a_load_failing_on_one_rank_rolls_the_other_back_to_its_exact_previous_shards():
    engines = [_engine(), _engine()]
    before = [e.snapshot() for e in engines]
    rounds = Rounds()
    commits = [AgreedCommit(rounds.agree_as(0), 0, engines[0]),
               AgreedCommit(rounds.agree_as(1), 1, engines[1], _failing_commit(engines[1]), rollback=False)]
    errors = _run(commits, [_next_version(e) for e in engines])
    for error in errors:
        assert isinstance(error, SyncAbortedError) and "device lost halfway" in str(error)
        assert [rank for rank, _ in error.failures] == [1]
    assert engines[0].version == 0
    assert all(torch.equal(t, before[0][n]) for n, t in engines[0].snapshot().items())
    assert commits[0].snapshots_taken == 1


def test_a_rank_that_cannot_keep_its_rollback_copy_loads_nothing_and_nobody_keeps_the_version():
    engines = [_engine(), _engine()]
    before = [e.snapshot() for e in engines]

    def no_copy(version: int):
        raise MemoryError("no room for a copy of the live shards")

    rounds = Rounds()
    commits = [AgreedCommit(rounds.agree_as(0), 0, engines[0], live_shards=no_copy),
               AgreedCommit(rounds.agree_as(1), 1, engines[1])]
    errors = _run(commits, [_next_version(e) for e in engines])
    for error in errors:
        assert isinstance(error, SyncAbortedError)
        assert error.failures[0][0] == 0 and "keeping the live shards for a rollback failed" in error.failures[0][1]
    for engine, old in zip(engines, before):
        assert engine.version == 0
        assert all(torch.equal(t, old[n]) for n, t in engine.snapshot().items())


def test_a_rank_that_failed_before_loading_keeps_every_rank_on_the_previous_version():
    engines = [_engine(), _engine()]
    before = [e.snapshot() for e in engines]
    rounds = Rounds()
    commits = [AgreedCommit(rounds.agree_as(r), r, engines[r]) for r in range(RANKS)]
    errors = _run(commits, [_next_version(engines[0]), {}], errors=(None, "cutting this rank's shards failed"))
    for error in errors:
        assert isinstance(error, SyncAbortedError) and error.failures == [(1, "cutting this rank's shards failed")]
    for engine, old in zip(engines, before):
        assert engine.version == 0
        assert all(torch.equal(t, old[n]) for n, t in engine.snapshot().items())


def test_every_rank_loading_commits_the_target_version_it_was_given():
    engines = [_engine(), _engine()]
    staged = [_next_version(e) for e in engines]
    rounds = Rounds()
    commits = [AgreedCommit(rounds.agree_as(r), r, engines[r]) for r in range(RANKS)]
    assert _run(commits, staged, as_version=7) == [None, None]
    for engine, want in zip(engines, staged):
        assert engine.version == 7
        assert all(torch.equal(t, want[n]) for n, t in engine.snapshot().items())


@pytest.mark.parametrize("failing", [0, 1])
def test_the_rank_whose_rollback_fails_is_named_beside_the_original_failure(failing):
    engines = [_engine(), _engine()]
    rounds = Rounds()
    loaded = 1 - failing
    calls = []

    def load_once(shards, version):  # the new version loads; loading the old one back fails
        calls.append(version)
        if len(calls) > 1:
            raise RuntimeError("rollback refused")
        engines[loaded].load_shards(shards, version)

    commits = [None, None]
    commits[failing] = AgreedCommit(rounds.agree_as(failing), failing, engines[failing],
                                    _failing_commit(engines[failing]), rollback=False)
    commits[loaded] = AgreedCommit(rounds.agree_as(loaded), loaded, engines[loaded], load_once)
    errors = _run(commits, [_next_version(e) for e in engines])
    assert [rank for rank, _ in errors[loaded].failures] == [failing, loaded]
    assert "rolling back to version 0 failed: rollback refused" in errors[loaded].failures[1][1]
    assert calls == [2, 0]
