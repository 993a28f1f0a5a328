"""The disk-delta transport's control and numbering, in one process (threads for the inference ranks).

The endpoints are the real ones (`DiskDeltaTransport` with its directory session,
`DeltaSender` into a real `DeltaWriter`, `DeltaReceiver` with real readers);
the weights come from the seeded fake stream and go into fake TP-sharding
engines, and every check compares bytes with what the stream produced.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.wait import poll
from megatron_sync.transports.disk_delta import receiver as delta_receiver
from megatron_sync.transports.disk_delta import session as sessions
from megatron_sync.transports.disk_delta.localcopy import open_committed
from megatron_sync.core.errors import PeerFailureError
from megatron_sync.transports import get_transport
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.transports.disk_delta.transport import DiskDeltaTransport, control_dir, latest_version
from tests.support.fakes import STAGES, FakeEngine, FakeStream, make_tensor, shard_rule
from tests.support.timing import bounded, scaled

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path, **extra) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({
        "transport": "disk_delta", "family": "qwen3", "num_inference_ranks": 2, "engine_tp_size": 2,
        "timeout_s": 20.0, "delta_dir": str(tmp_path / "shared"), "delta_local_dir": str(tmp_path / "host0"),
        "delta_snapshot_every": 3, "delta_retention": 2, "delta_encode_threads": 1, **extra})


class _Run:
    """One trainer run (a stage source per stage) and two inference ranks, each inference rank on its own thread."""

    def __init__(self, config: WeightSyncConfig, stages: int = 1) -> None:
        self.config, self.metas = config, [m for stage in STAGES[:stages] for m in stage]
        pool = ThreadPoolExecutor(3)
        inference = [pool.submit(self._connect_inference, r, stages) for r in range(2)]
        layouts = [SimpleNamespace(pp_rank=s, pp=stages, is_stage_source=True) for s in range(stages)]
        self.sources = [DiskDeltaTransport.connect_trainer(config, layout) for layout in reversed(layouts)][::-1]
        self.trainer = self.sources[0]  # the leader
        self.streams = [FakeStream(s, STAGES[s]) for s in range(stages)]
        self.senders = [DiskDeltaTransport.make_sender(t, st, config, ()) for t, st in zip(self.sources, self.streams)]
        self.ranks = [f.result(timeout=30) for f in inference]
        self.pool = pool

    def _connect_inference(self, rank: int, stages: int):
        transport = DiskDeltaTransport.connect_inference(self.config, num_trainer_stages=stages, inference_rank=rank)
        return transport, FakeEngine(self.metas, rank, 2)

    def make_receivers(self) -> None:
        futures = [self.pool.submit(t.make_receiver, e, self.config, ()) for t, e in self.ranks]
        self.receivers = [f.result(timeout=30) for f in futures]

    def sync(self, version: int, stream_version: int) -> None:
        """The driver's trainer side: announce, then submit on every stage (writers publish in the background)."""
        self.trainer.control.send(ControlMessage(ControlOp.SYNC, version))
        for stream, sender in zip(self.streams, self.senders):
            stream.version = stream_version
            sender.sync(version)

    def serve_one(self) -> list:
        """The driver's inference side for one message, on both ranks; return their metrics."""
        def one(index: int):
            transport, _ = self.ranks[index]
            message = transport.control.next(30)
            metrics = self.receivers[index].receive(message.version)
            transport.control.report(Report.METRICS, message.version, transport.rank, metrics.to_json().encode())
            return metrics

        return [f.result(timeout=60) for f in [self.pool.submit(one, i) for i in range(2)]]

    def close(self) -> None:
        for transport, _ in self.ranks:
            transport.close()
        for source in self.sources:
            source.close()
        self.pool.shutdown()


def _assert_holds(run: _Run, version: int, stream_version: int) -> None:
    for stage, metas in enumerate(STAGES[:len(run.sources)]):
        held, tensors = open_committed(os.path.join(run.config.delta_local_dir, f"stage-{stage}"))
        assert held == version
        for meta in metas:
            assert torch.equal(tensors[meta.name].view(torch.uint8), make_tensor(meta, stream_version).view(torch.uint8))
    for tp_rank, (_, engine) in enumerate(run.ranks):
        assert engine.version == version
        for meta in run.metas:
            assert torch.equal(engine.weights[meta.name], shard_rule(meta, make_tensor(meta, stream_version), tp_rank, 2))


def test_the_registry_builds_it_and_the_config_requires_its_directories(tmp_path):
    assert get_transport("disk_delta") is DiskDeltaTransport
    with pytest.raises(ValueError, match="transport='disk_delta' needs delta_dir"):
        WeightSyncConfig(transport="disk_delta")
    with pytest.raises(ValueError, match="delta_when_behind must be one of"):
        _config(tmp_path, delta_when_behind="drop")
    with pytest.raises(ValueError, match="delta_retention must be an integer >= 1"):
        _config(tmp_path, delta_retention=0)


def test_versions_arrive_and_a_restarted_trainer_numbers_above_the_store(tmp_path):
    config = _config(tmp_path)
    run = _Run(config)
    run.make_receivers()
    for version in (1, 2, 3):
        run.sync(version, stream_version=version)
        metrics = run.serve_one()
        _assert_holds(run, version, version)
        assert metrics[0].bytes > 0 and metrics[1].bytes == 0  # rank 0 applies for the host, rank 1 reads its file
    reports = run.trainer.control.collect(Report.METRICS, 3, run.trainer.inference_ranks)
    assert sorted(reports) == [1, 2]
    run.close()
    assert latest_version(config.delta_dir) == 3

    # A new trainer run on the same store: its first sync is store version 4, and engines hold 4.
    again = _Run(config)
    assert again.trainer.version_offset == 3
    again.make_receivers()
    again.sync(1, stream_version=10)
    (metrics, _) = again.serve_one()
    assert metrics.version == 1  # the driver's numbering in the report ...
    _assert_holds(again, 4, 10)  # ... the store's on the engines and in the local copy
    again.close()


def test_sync_means_the_newest_published_version_and_a_held_one_is_a_no_op(tmp_path):
    run = _Run(_config(tmp_path))
    run.make_receivers()
    run.sync(1, stream_version=1)
    run.sync(2, stream_version=2)
    run.trainer.writer.flush(timeout=30)
    first = run.serve_one()  # "sync 1" finds 2 published already: it applies 2
    _assert_holds(run, 2, 2)
    second = run.serve_one()  # "sync 2": every rank holds it
    _assert_holds(run, 2, 2)
    assert first[0].bytes > 0 and second[0].bytes == 0 and second[0].phases["apply"] == 0
    run.close()


def test_a_session_left_by_an_earlier_run_is_never_joined(tmp_path, monkeypatch):
    folder = str(tmp_path / "control")
    stale = sessions.Session("old", folder, 7, 1, 1)
    os.makedirs(os.path.join(stale.folder, "board"))
    with open(os.path.join(folder, sessions.SESSION), "w") as f:
        json.dump(stale.to_json(), f)
    with open(os.path.join(stale.folder, "started"), "w") as f:
        json.dump({"0": "a token of the earlier run"}, f)
    looked_again = _read_again_after_joining(monkeypatch, os.path.join(stale.folder, "joined", "0"))
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(sessions.join_session, folder, inference_rank=0, num_stages=1, num_inference_ranks=1,
                              timeout_s=20)
        poll(lambda: looked_again.is_set() or joining.done(), within=scaled(20),
             what="the joiner reading session.json again after joining the stale session")
        assert looked_again.is_set() and not joining.done()  # the stale "started" lacks this rank's token
        live = sessions.open_session(folder, version_offset=9, num_stages=1, num_inference_ranks=1, timeout_s=20)
        joined = joining.result(timeout=20)
    assert joined.id == live.id != "old" and joined.version_offset == 9
    assert not os.path.exists(stale.folder)


def _read_again_after_joining(monkeypatch, joined: str) -> threading.Event:
    """Return an event set when a joiner reads session.json while its ticket `joined` exists: it posted the
    ticket, checked that session's "started" and went round its wait again (the real read runs)."""
    real, looked_again = sessions.read_session, threading.Event()

    def read_session(control_dir: str):
        if os.path.exists(joined):
            looked_again.set()
        return real(control_dir)

    monkeypatch.setattr(sessions, "read_session", read_session)
    return looked_again


def test_ranks_of_an_old_session_fail_when_a_new_trainer_opens_one(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(sessions.join_session, folder, inference_rank=0, num_stages=1, num_inference_ranks=1,
                              timeout_s=20)
        old = sessions.open_session(folder, version_offset=0, num_stages=1, num_inference_ranks=1, timeout_s=20)
        joining.result(timeout=20)
        board = sessions.DirectoryBoard(old.folder, rank=1, timeout_s=30, alive=sessions.liveness_check(old))
        waiting = pool.submit(board.fetch, "control/1")
        # noticed within about a second (the liveness check), not at the board's 30 s timeout
        with bounded(5, "the old session's waiting rank noticing the new run") as bound:
            with pytest.raises(PeerFailureError, match="did not join"):  # nobody joins the new run here
                sessions.open_session(folder, version_offset=0, num_stages=1, num_inference_ranks=1, timeout_s=0.2)
            with pytest.raises(PeerFailureError, match=f"session {old.id} in .* is over: a new trainer run opened"):
                waiting.result(timeout=bound.deadline.remaining(floor=0.01))


def _looks_finding(version: int, monkeypatch) -> collections.Counter:
    """Return a counter, per thread, of the receivers' looks at a stage's store that found `version` published
    there (the real look runs; a receiver looks at every stage's store once per round of its wait)."""
    real, looks = delta_receiver.published_versions, collections.Counter()

    def published_versions(store: str) -> list[int]:
        versions = real(store)
        if version in versions:
            looks[threading.get_ident()] += 1
        return versions

    monkeypatch.setattr(delta_receiver, "published_versions", published_versions)
    return looks


def test_the_leader_names_the_ranks_that_never_joined(tmp_path):
    with pytest.raises(PeerFailureError, match=r"inference ranks \[0, 1\] did not join .* within 0.3s"):
        sessions.open_session(str(tmp_path / "control"), version_offset=0, num_stages=1, num_inference_ranks=2,
                              timeout_s=0.3)


def test_an_inference_job_with_another_shape_is_refused(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(sessions.join_session, folder, inference_rank=0, num_stages=2, num_inference_ranks=1,
                              timeout_s=20)
        sessions.open_session(folder, version_offset=0, num_stages=1, num_inference_ranks=1, timeout_s=20)
        with pytest.raises(ValueError, match="pass --trainer-stages 1"):
            joining.result(timeout=20)


def test_the_file_gather_returns_every_rank_in_order_and_cleans_up(tmp_path):
    board_dir = str(tmp_path / "session")
    gathers = [sessions.FileGather(sessions.DirectoryBoard(board_dir, rank=r, timeout_s=20), name="g", index=r, size=3)
               for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        for round_ in range(1, 5):
            futures = [pool.submit(g, {"rank": r, "round": round_}) for r, g in enumerate(gathers)]
            assert all(f.result(timeout=20) == [{"rank": r, "round": round_} for r in range(3)] for f in futures)
    assert os.listdir(os.path.join(board_dir, "board", "gather", "g")) == ["4"]  # earlier rounds are gone
    assert sorted(os.listdir(os.path.join(board_dir, "board", "gather", "g", "4"))) == ["0", "1", "2"]


def test_two_pipeline_stages_publish_apart_and_engines_apply_only_versions_both_hold(tmp_path, monkeypatch):
    run = _Run(_config(tmp_path), stages=2)
    run.make_receivers()
    for version in (1, 2):
        run.sync(version, stream_version=version)
        run.serve_one()
        _assert_holds(run, version, version)
    with pytest.raises(RuntimeError, match="only the leader"):
        run.sources[1].control.send(ControlMessage(ControlOp.SYNC, 3))
    # Stage 1 runs behind: "sync 3" waits until both stages hold version 3.
    run.trainer.control.send(ControlMessage(ControlOp.SYNC, 3))
    run.streams[0].version = 3
    run.senders[0].sync(3)
    looks = _looks_finding(3, monkeypatch)
    serving = run.pool.submit(run.serve_one)
    # the applier found 3 in stage 0's store (only there) in two rounds: after the first it chose to wait
    poll(lambda: max(looks.values(), default=0) >= 2 or serving.done(), within=scaled(30),
         what="the applier finding version 3 in stage 0's store twice")
    assert max(looks.values()) >= 2 and not serving.done() and run.ranks[0][1].version == 2
    run.streams[1].version = 3
    run.senders[1].sync(3)
    serving.result(timeout=60)
    _assert_holds(run, 3, 3)
    run.close()
