"""A fleet of engines, each its own process, against one trainer: membership, waves, relay, fallback.

Fake engines (seeded reference tensors, checked bit for bit at every commit) keep these fast; the launched
Megatron trainer and reference engines are in test_fleet_jobs.py. The test drives the script: the trainer
syncs a version only when told, so engines are killed and restarted between syncs at known points.
"""

from __future__ import annotations

import multiprocessing

import pytest

from tests.support.dist import free_port
from tests.support import procs
from tests.support.fleet_fakes import drain, drain_while, engine_main, model_bytes, trainer_main

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


class Fleet:
    """The processes of one run: a trainer and engines that come and go."""

    def __init__(self, versions: list[int], **changes) -> None:
        self.ctx = procs.context()
        self.port, self.changes = free_port(), changes
        self.go, self.reports = self.ctx.Queue(), self.ctx.Queue()
        self.trainer = procs.process(trainer_main, (self.port, changes, versions, self.go, self.reports))
        self.engines: dict[int, multiprocessing.Process] = {}
        self.seen: list[tuple] = []

    def start_engine(self, engine: int, **faults) -> None:
        proc = procs.process(engine_main, (self.port, self.changes, engine, self.reports), faults)
        proc.start()
        self.engines[engine] = proc

    def kill(self, engine: int) -> None:
        self.engines[engine].kill()
        self.engines[engine].join(10)

    def wait_for(self, until) -> list[tuple]:
        """Return the reports up to the first (already seen, or still to come) that satisfies `until`."""
        if any(until(report) for report in self.seen):
            return self.seen
        got = drain(self.reports, until)
        self.seen += got
        return got

    def sync(self, version: int, admitted: dict | None = None) -> tuple:
        """Let the trainer sync `version` once the engines in `admitted` (engine -> generation) were admitted;
        return its report (version, fleet rows, staleness, linked engines)."""
        self.go.put((version, admitted or {}))
        return self.wait_for(lambda r: r[0] == "synced" and r[1] == version)[-1]

    @staticmethod
    def _commits(reports: list[tuple], version: int) -> dict[int, bool]:
        return {r[1]: r[3] for r in reports if r[0] == "commit" and r[2] == version}

    def commits(self, version: int, engines: set[int]) -> dict[int, bool]:
        """engine -> exact, of every commit of `version` reported, once every engine of `engines` reported its
        own (reports of several processes reach one queue in no set order: an engine's commit can arrive after
        the trainer's "synced"); an engine missing after the bound is simply absent from the answer."""
        self.seen += drain_while(self.reports, lambda got: not engines <= set(self._commits(self.seen + got, version)))
        return self._commits(self.seen, version)

    def close(self) -> None:
        for proc in [self.trainer, *self.engines.values()]:
            proc.join(30)
        for proc in [self.trainer, *self.engines.values()]:
            if proc.is_alive():
                proc.kill()


def _rows(report: tuple) -> dict[int, dict]:
    """engine -> its delivery row in a trainer's "synced" report."""
    return {row["engine"]: row for row in report[2] if "outcome" in row}


def _events(report: tuple) -> list[tuple]:
    return [(row["event"], row["engine"], row["generation"]) for row in report[2] if "event" in row]


def test_engines_leave_between_and_during_syncs_and_a_restarted_one_rejoins_on_the_current_version():
    """Three engines. Engine 1 is killed between v1 and v2 (the trainer finds it gone at v2's boundary: it does
    not answer); engine 2 dies a few tensors into v3; engine 1, restarted, rejoins at v4 (its earlier job gone).
    The trainer never fails; every commit of every engine is exact; the rejoined engine serves v4 (the current
    version) exactly; the metrics name each join, leave and rejoin."""
    fleet = Fleet([1, 2, 3, 4])
    try:
        fleet.trainer.start()
        for engine in (0, 1):
            fleet.start_engine(engine)
        fleet.start_engine(2, die_at=3)
        fleet.wait_for(lambda r: r[0] == "started")
        v1 = fleet.sync(1)
        assert v1[4] == [0, 1, 2] and fleet.commits(1, {0, 1, 2}) == {0: True, 1: True, 2: True}
        assert sorted(_events(v1)) == [("joined", 0, 0), ("joined", 1, 0), ("joined", 2, 0)]

        fleet.kill(1)  # between syncs: noticed at the boundary, before the sync starts (no delivery is tried)
        v2 = fleet.sync(2)
        assert fleet.commits(2, {0, 2}) == {0: True, 2: True}
        assert 1 not in _rows(v2) and v2[4] == [0, 2]
        left = [row for row in v2[2] if row.get("event") == "left" and row["engine"] == 1]
        assert len(left) == 1 and "did not answer at the sync boundary" in left[0]["detail"], left

        v3 = fleet.sync(3)  # engine 2 dies mid-sync
        assert fleet.commits(3, {0}) == {0: True}
        assert _rows(v3)[2]["outcome"] == "failed" and v3[4] == [0]
        assert ("left", 2, 0) in _events(v3)

        fleet.start_engine(1)  # restarted: the same id, a new job, linked at the boundary of v4
        v4 = fleet.sync(4, admitted={1: 1})
        assert fleet.commits(4, {0, 1}) == {0: True, 1: True}
        assert ("rejoined", 1, 1) in _events(v4) and v4[4] == [0, 1]
        assert _rows(v4)[1] == {**_rows(v4)[1], "generation": 1, "outcome": "committed", "source": "trainer"}
        fleet.wait_for(lambda r: r[0] == "trainer-exit")
        fleet.wait_for(lambda r: r[0] == "engine-exit" and r[1] == 1)
    finally:
        fleet.close()
    exits = {r[1]: (r[2], r[3]) for r in fleet.seen if r[0] == "engine-exit"}
    assert exits[0] == (4, "stopped") and exits[1] == (4, "stopped")


def test_waves_of_one_update_one_engine_at_a_time():
    """wave_size 1: each engine's update window (from taking the version in to committing it) ends before the
    next engine's begins, so at every moment the other two serve; every commit exact."""
    fleet = Fleet([1, 2], wave_size=1)
    try:
        fleet.trainer.start()
        for engine in range(3):
            fleet.start_engine(engine)
        fleet.wait_for(lambda r: r[0] == "started")
        for version in (1, 2):
            report = fleet.sync(version)
            assert fleet.commits(version, {0, 1, 2}) == {0: True, 1: True, 2: True}
            assert [_rows(report)[e]["wave"] for e in range(3)] == [1, 2, 3]
        fleet.wait_for(lambda r: r[0] == "trainer-exit")
        for engine in range(3):
            fleet.wait_for(lambda r, engine=engine: r[0] == "engine-exit" and r[1] == engine)
    finally:
        fleet.close()
    windows = {r[1]: r[4] for r in fleet.seen if r[0] == "engine-exit"}
    for version in (1, 2):
        spans = sorted((start, end, engine) for engine in range(3) for v, start, end in windows[engine] if v == version)
        assert [engine for _, _, engine in spans] == [0, 1, 2]
        for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
            assert end <= start, spans  # one engine updating at a time: the other two serve throughout


def test_relay_sends_one_copy_from_the_trainer_and_a_dying_relay_falls_back_to_it():
    """relay: the trainer feeds one engine, the others take the version from engines that hold it: the
    trainer's bytes per version are one model (against three without relay). At v2 the relaying engine dies
    as its relay begins; its destination falls back to the trainer and still commits v2 exactly."""
    fleet = Fleet([1, 2], relay=True)
    try:
        fleet.trainer.start()
        fleet.start_engine(0, relay_dies_at=2)
        for engine in (1, 2):
            fleet.start_engine(engine)
        fleet.wait_for(lambda r: r[0] == "started")
        v1 = fleet.sync(1)
        assert fleet.commits(1, {0, 1, 2}) == {0: True, 1: True, 2: True}
        rows = _rows(v1)
        assert [rows[e]["source"] for e in range(3)] == ["trainer", "engine 0", "engine 0"]
        assert sum(row["trainer_bytes"] for row in rows.values()) == model_bytes()

        v2 = fleet.sync(2)  # engine 0 commits v2 from the trainer, then dies as it relays it to engine 1
        assert fleet.commits(2, {0, 1, 2}) == {0: True, 1: True, 2: True}
        to_1 = [(row["source"], row["outcome"]) for row in v2[2] if row.get("engine") == 1]
        assert to_1 == [("engine 0", "aborted"), ("trainer", "committed")], v2[2]
        assert _rows(v2)[2]["source"] == "trainer"  # its relay source had left
        assert v2[4] == [1, 2] and ("left", 0, 0) in _events(v2)
    finally:
        fleet.close()


def test_bounded_staleness_lets_later_waves_update_while_the_trainer_goes_on():
    """max_staleness 1 with waves of one: sync(v) returns after the first wave; engines 1 and 2 take v in the
    background, and the next sync first waits for them, so its report carries their rows of v (committed)
    and no engine serving is ever more than one version behind; every commit exact."""
    fleet = Fleet([1, 2, 3], wave_size=1, max_staleness=1)
    try:
        fleet.trainer.start()
        for engine in range(3):
            fleet.start_engine(engine)
        fleet.wait_for(lambda r: r[0] == "started")
        for version in (1, 2, 3):
            report = fleet.sync(version)
            now = [row for row in report[2] if "outcome" in row and row["version"] == version]
            assert [(row["engine"], row["wave"]) for row in now] == [(0, 1)], report[2]  # only the first wave
            assert report[3] in (0, 1)  # the staleness stated when sync() returned
            if version > 1:  # the later waves of the previous version, finished before this sync began
                late = [row for row in report[2] if "outcome" in row and row["version"] == version - 1]
                assert sorted((row["engine"], row["wave"], row["outcome"]) for row in late) == \
                    [(1, 2, "committed"), (2, 3, "committed")], report[2]
        fleet.wait_for(lambda r: r[0] == "trainer-exit")
        for engine in range(3):
            fleet.wait_for(lambda r, engine=engine: r[0] == "engine-exit" and r[1] == engine)
    finally:
        fleet.close()
    for version in (1, 2, 3):
        assert fleet.commits(version, {0, 1, 2}) == {0: True, 1: True, 2: True}
