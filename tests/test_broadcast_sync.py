"""Multi-process gloo runs: 2 stage sources -> 2 receivers of one TP=2 fake engine."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from megatron_sync.core.errors import PeerFailureError, PlanMismatchError, SyncAbortedError, SyncError
from megatron_sync.core.metrics import SyncMetrics, format_table
from megatron_sync.transports.buckets.receiver import WeightReceiver
from megatron_sync.transports.buckets.sender import WeightSender
from megatron_sync.transports.broadcast import BroadcastTransport
from megatron_sync.session.group import init_transport_group
from tests.support.dist import free_port, run_ranks
from tests.support.fakes import STAGES, FakeEngine, FakeStream, make_tensor, shard_rule, wire_corruption
from tests.support.timing import bounded

P, N, TP = 2, 2, 2
BUCKET_BYTES = 2048
ALL_METAS = [m for stage in STAGES for m in stage]

pytestmark = pytest.mark.multiproc


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _engine_matches(engine: FakeEngine) -> bool:
    """True when every shard the engine holds equals the reference slice of its version, bit for bit."""
    if engine.version == 0:
        return not engine.weights
    return all(
        torch.equal(_bits(engine.weights[m.name].cpu()),
                    _bits(shard_rule(m, make_tensor(m, engine.version), engine.tp_rank, TP)))
        for m in ALL_METAS
    )


def _rank_main(rank: int, sc: dict) -> list:
    backend = sc.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = init_transport_group("127.0.0.1", sc["port"], P + N, rank, backend=backend,
                                 timeout=sc.get("timeout", 20.0), group_name="test")
    transport = BroadcastTransport(group, P)
    bucket = sc.get("bucket_bytes", {}).get(rank, BUCKET_BYTES)
    try:
        if rank < P:
            return _run_sender(rank, transport, bucket, sc)
        return _run_receiver(rank, transport, bucket, sc)
    finally:
        transport.close()


def _run_sender(rank: int, transport, bucket: int, sc: dict) -> list:
    stream = FakeStream(rank, STAGES[rank], fail_at=tuple(sc.get("fail_at", ())) if rank == 1 else None)
    sender = WeightSender.connect(stream, transport, bucket_size_bytes=bucket,
                                  corrupt_wire=wire_corruption(stream, sc.get("corrupt", ())),
                                  metrics_path=sc.get("metrics_path") if rank == 0 else None)
    log = []
    for v in sc["versions"]:
        stream.version = v
        with version_bound(sc, v, f"stage {rank}'s sync of version {v}"):
            try:
                metrics = sender.sync(v)
                log.append((v, "ok", metrics.bytes, metrics.num_buckets))
            except SyncError as e:
                log.append((v, type(e).__name__, str(e)))
                if isinstance(e, PeerFailureError):
                    break
    return log


def version_bound(sc: dict, version: int, what: str) -> contextlib.AbstractContextManager:
    """Return the bound on a rank's sync of `version`: `sc["ends_within"] = {version: seconds}` says it ends
    (failing, in these tests) within `seconds`, scaled for load; no bound for a version not named."""
    seconds = sc.get("ends_within", {}).get(version)
    return contextlib.nullcontext() if seconds is None else bounded(seconds, what)


def _run_receiver(rank: int, transport, bucket: int, sc: dict) -> list:
    die = sc.get("die", {})
    engine = FakeEngine(ALL_METAS, rank - P, TP, die_after_shards=die.get(rank),
                        fail_load_at=sc.get("fail_load", {}).get(rank))
    receiver = WeightReceiver(engine, transport, bucket_size_bytes=bucket, staging_sets=sc.get("staging_sets", 2))
    log = []
    for v in sc["versions"]:
        try:
            receiver.receive(v)
            outcome = "ok"
        except SyncError as e:
            outcome = type(e).__name__
            log.append((v, outcome, engine.version, _engine_matches(engine), str(e)))
            if isinstance(e, PeerFailureError):
                break
            continue
        log.append((v, outcome, engine.version, _engine_matches(engine), ""))
    return log


def _run(sc: dict, timeout: float = 60.0) -> dict:
    sc = {"port": free_port(), **sc}
    return run_ranks(_rank_main, P + N, sc, timeout=timeout, init_group=False)


def test_syncs_exact_then_corrupt_and_sender_failure_abort_everywhere(tmp_path):
    """v1, v2 succeed (exact shards); v3 has a flipped byte; v4's stage-1 stream fails; v5 recovers."""
    metrics_path = str(tmp_path / "sync.jsonl")
    out = _run({"versions": [1, 2, 3, 4, 5], "corrupt": (3, 1),
                "fail_at": (4, "model.norm.weight"), "metrics_path": metrics_path})
    outcomes = ["ok", "ok", "SyncAbortedError", "SyncAbortedError", "ok"]
    for rank in range(P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert [entry[1] for entry in log] == outcomes, (rank, log)
        corrupt_msg, failure_msg = (log[2][-1], log[3][-1]) if rank >= P else (log[2][2], log[3][2])
        assert "CorruptBucketError" in corrupt_msg and "bucket 1 (stage 0" in corrupt_msg
        assert "fake conversion failure at model.norm.weight" in failure_msg
    for rank in range(P, P + N):
        versions_held = [entry[2:4] for entry in out[rank][1]]
        assert versions_held == [(1, True), (2, True), (2, True), (2, True), (5, True)]
    lines = [json.loads(line) for line in open(metrics_path)]
    assert [m["version"] for m in lines] == [1, 2, 5]  # only committed syncs are recorded
    assert all(m["bytes"] > 0 and m["num_buckets"] > 1 for m in lines)
    assert all(m["phases_s"]["gather"] > 0 and m["phases_s"]["total"] > 0 and m["overlap_s"] >= 0 for m in lines)
    rows = [SyncMetrics(m["version"], "sender", 0, phases=m["phases_s"], bytes=m["bytes"]) for m in lines]
    assert len(format_table(rows).splitlines()) == 4


def test_plan_mismatch_fails_every_rank_at_startup():
    out = _run({"versions": [1], "bucket_bytes": {3: 4096}})
    for rank in range(P + N):
        status, message = out[rank]
        assert status == "PlanMismatchError", (rank, status, message)
        assert "ranks [0, 1, 2]" in message and "ranks [3]" in message


def test_dead_receiver_makes_sender_raise_peer_failure_and_survivor_keeps_version():
    timeout = 6.0
    die_after = len(ALL_METAS) + 3  # dies while staging version 2
    # the senders' sync of version 2 fails within the group's timeout (+5 s), else that rank fails
    out = _run({"versions": [1, 2], "die": {3: die_after}, "timeout": timeout, "ends_within": {2: timeout + 5}})
    assert out[3][0] == "exited" and out[3][1] == 17, out
    for rank in range(P):
        status, log = out[rank]
        assert status == "ok", log
        assert log[0][1] == "ok"
        assert log[1][1] == "PeerFailureError", log
        assert "expected transport ranks 0..3" in log[1][2]
    status, log = out[2]
    assert status == "ok", log
    assert log[1][1:4] == ("PeerFailureError", 1, True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < P + N, reason=f"needs {P + N} GPUs for NCCL")
def test_nccl_two_syncs_deliver_exact_shards():
    out = _run({"versions": [1, 2], "backend": "nccl"})
    for rank in range(P, P + N):
        status, log = out[rank]
        assert status == "ok", log
        assert [entry[:4] for entry in log] == [(1, "ok", 1, True), (2, "ok", 2, True)]


@pytest.mark.parametrize("staging_sets", [2, 1])
def test_a_load_failing_on_one_rank_rolls_the_other_ranks_back(staging_sets):
    # Rank 3's load of version 2 fails after every rank agreed the buckets were intact; rank 2 has
    # loaded it by then and must go back, so the engine never serves a mix of versions 1 and 2. With one
    # staging set, version 2 has overwritten version 1's set: rank 2 goes back from its host copy.
    out = _run({"versions": [1, 2, 3], "fail_load": {3: 2}, "staging_sets": staging_sets})
    for rank in range(P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert [entry[1] for entry in log] == ["ok", "SyncAbortedError", "ok"], (rank, log)
    for rank in range(P, P + N):
        versions_held = [entry[2:4] for entry in out[rank][1]]
        assert versions_held == [(1, True), (1, True), (3, True)], (rank, versions_held)
        assert "fake load failure at version 2" in out[rank][1][1][4]


CHECKSUMS = ("xxh3", "crc32", "wsum64", "none")


def _integrity_main(rank: int, sc: dict) -> list:
    """Per checksum choice: one clean version, then one whose bucket 1 has a byte flipped on the wire;
    finally a rank that checks differently from the others is refused at start-up."""
    group = init_transport_group("127.0.0.1", sc["port"], P + N, rank, timeout=20.0, group_name="test")
    transport = BroadcastTransport(group, P)
    stream = FakeStream(rank, STAGES[rank]) if rank < P else None
    engine = FakeEngine(ALL_METAS, rank - P, TP) if rank >= P else None
    log, version = [], 0
    try:
        for algorithm in CHECKSUMS:
            if rank < P:
                side = WeightSender.connect(stream, transport, bucket_size_bytes=BUCKET_BYTES, checksum=algorithm,
                                            corrupt_wire=wire_corruption(stream, (version + 2, 1)))
            else:
                side = WeightReceiver(engine, transport, bucket_size_bytes=BUCKET_BYTES, checksum=algorithm)
            for _ in range(2):
                version += 1
                try:
                    if rank < P:
                        stream.version = version
                        side.sync(version)
                    else:
                        side.receive(version)
                    outcome = "ok"
                except SyncAbortedError as e:
                    outcome = "CorruptBucketError" if "CorruptBucketError" in str(e) else str(e)
                log.append((algorithm, version, outcome, engine and engine.version, engine and _engine_matches(engine)))
        mine = "crc32" if rank == P + N - 1 else "xxh3"
        try:
            if rank < P:
                WeightSender.connect(stream, transport, bucket_size_bytes=BUCKET_BYTES, checksum=mine)
            else:
                WeightReceiver(engine, transport, bucket_size_bytes=BUCKET_BYTES, checksum=mine)
            log.append(("mismatch", "accepted"))
        except PlanMismatchError as e:
            log.append(("mismatch", str(e)))
    finally:
        transport.close()
    return log


def test_every_checksum_choice_catches_a_flipped_byte_and_none_trusts_the_wire():
    out = run_ranks(_integrity_main, P + N, {"port": free_port()}, timeout=90.0, init_group=False)
    for rank, (status, log) in out.items():
        assert status == "ok", (rank, status, log)
    logs = {rank: log for rank, (_, log) in out.items()}
    for i, algorithm in enumerate(CHECKSUMS):
        clean, corrupt = 2 * i + 1, 2 * i + 2
        for rank in range(P + N):
            entries = {v: entry for (a, v, *entry) in logs[rank][:-1] if a == algorithm}
            assert entries[clean][0] == "ok", (algorithm, rank, entries)
            assert entries[corrupt][0] == ("ok" if algorithm == "none" else "CorruptBucketError"), (algorithm, rank)
        for rank in range(P, P + N):
            entries = {v: entry for (a, v, *entry) in logs[rank][:-1] if a == algorithm}
            assert entries[clean][1:] == [clean, True], (algorithm, rank)  # bit-exact shards
            if algorithm != "none":
                assert entries[corrupt][1:] == [clean, True], (algorithm, rank)  # kept the previous version
        if algorithm == "none":  # nothing checked: the flipped byte reached an engine
            assert any(not {v: e for (a, v, *e) in logs[r][:-1] if a == algorithm}[corrupt][2]
                       for r in range(P, P + N))
    for rank in range(P + N):
        kind, message = logs[rank][-1]
        assert kind == "mismatch" and "check buckets differently" in message and "-> crc32" in message, message
