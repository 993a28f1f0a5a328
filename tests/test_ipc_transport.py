"""Transport `ipc`: shared segments, then multi-process runs (2 stage sources -> one TP=2 fake engine).

The segments are checked alone first (the bytes one process writes are the bytes another maps; a
stale or foreign segment and a full /dev/shm are refused by name). Then the generic bucket sender and
receiver run over the ipc transport, as in tests/test_broadcast_sync.py: exact shards, a byte flipped
in shared memory caught by the checksum, a failing stage aborted everywhere, the next version
recovered; each receiver copies exactly its shard's bytes and holds no receive buffer, and nothing
but control messages crosses the store's socket. Twenty versions leave no trace: no new file
descriptors, mappings, /dev/shm names or resident memory. A stage source killed while handing a
bucket over, or an engine rank killed while applying one: every survivor reports within timeout_s,
the engine stays on the previous version, and no segment is left in /dev/shm.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.transports import get_transport
from megatron_sync.transports.ipc.transport import IpcTransport
from megatron_sync.session.rendezvous import Identity
from megatron_sync.transports.ipc.segments import (
    NAME_PREFIX, SEGMENT_DIR, HostSegment, SegmentInfo, leftover_segments, segment_name,
)
from megatron_sync.session.session import SyncSession, new_session_id
from tests.support.dist import free_port, run_ranks
from tests.support.fakes import STAGES, FakeEngine, FakeStream, make_tensor, shard_rule, wire_corruption
from tests.test_broadcast_sync import version_bound

P, N, TP = 2, 2, 2
BUCKET_BYTES = 2048
ALL_METAS = [m for stage in STAGES for m in stage]
# Control messages only: a bucket's header (~60 bytes of key and JSON) and each receiver's release of its
# slot (~25 bytes per receiver); per sync, the agreement rounds (~40 bytes per rank and round).
CONTROL_BYTES_PER_BUCKET = 200
CONTROL_BYTES_PER_SYNC = 1000
RSS_SLACK_KIB = 1024  # allocator and interpreter noise; a copy of a slot or a shard per sync would exceed it


# ---------------------------------------------------------------- the segments alone


def test_a_mapped_segment_shares_the_creators_bytes_and_outlives_its_name():
    name = segment_name("test-" + os.urandom(4).hex(), 0, os.urandom(16).hex())
    created = HostSegment.create(name, 0, 4096, "t" * 32)
    try:
        mapped = HostSegment.attach(created.info)
        assert created.info.nbytes == os.path.getsize(os.path.join(SEGMENT_DIR, name))
        created.slot(1)[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
        created.unlink()
        assert name not in os.listdir(SEGMENT_DIR)
        assert mapped.slot(1)[:5].tolist() == [1, 2, 3, 4, 5]  # the mapping survives the name
        assert mapped.slot(0).data_ptr() % 4096 == 0 and mapped.slot(1).numel() == 4096
        mapped.close()
    finally:
        created.unlink()
        created.close()


def test_a_stale_or_foreign_segment_and_a_missing_one_are_refused_by_name():
    name = segment_name("test-" + os.urandom(4).hex(), 1, os.urandom(16).hex())
    created = HostSegment.create(name, 1, 4096, "a" * 32)
    try:
        foreign = SegmentInfo(**{**created.info.__dict__, "token": "b" * 32})
        with pytest.raises(ValueError, match="not trainer stage 1's segment of this session"):
            HostSegment.attach(foreign)
        created.unlink()
        with pytest.raises(ValueError, match=r"does not exist here .* needs every inference rank on the trainer's "
                                             r"host, sharing its /dev/shm .* use transport 'broadcast' or 'p2p'"):
            HostSegment.attach(created.info)
    finally:
        created.unlink()
        created.close()


def test_a_segment_that_does_not_fit_in_dev_shm_is_refused_at_creation_and_leaves_nothing():
    name = segment_name("test-" + os.urandom(4).hex(), 0, os.urandom(16).hex())
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes of shared memory for trainer stage 0 under /dev/shm "
                                      r"\(\d+ bytes free\): enlarge it .* or lower weight_sync.bucket_size_mb"):
        HostSegment.create(name, 0, 2**50, "c" * 32)
    assert name not in os.listdir(SEGMENT_DIR)


def test_ipc_is_a_registered_transport_and_refuses_sglang_engines():
    assert get_transport("ipc") is IpcTransport
    assert WeightSyncConfig(transport="ipc").transport == "ipc"
    with pytest.raises(ValueError, match="transport 'ipc' writes into megatron-sync receivers' memory, .* use "
                                         "transport 'sglang' for SGLang"):
        WeightSyncConfig(transport="ipc", engines=["sglang=http://127.0.0.1:30000"])


# ---------------------------------------------------------------- through the bucket sender and receiver


def _session(rank: int, sc: dict) -> SyncSession:
    """Host (rank 0) or join the run's sync session; return it ready."""
    me = Identity(job="", role="member", member=rank, expects={"world_size": P + N}, session=sc["session"])
    where = ("127.0.0.1", sc["port"])
    session = (SyncSession.host(*where, me, members={"member": P + N}, timeout_s=sc["timeout"]) if rank == 0
               else SyncSession.join(*where, me, timeout_s=sc["timeout"]))
    session.wait_ready()
    return session


def _config(sc: dict, bucket: int = BUCKET_BYTES) -> WeightSyncConfig:
    return WeightSyncConfig(transport="ipc", backend=sc.get("backend", "gloo"), num_inference_ranks=N,
                            timeout_s=sc["timeout"], bucket_size_mb=bucket / 2**20)


def _resources(session_id: str) -> dict:
    """What this process holds now: open fds, mappings of ipc segments, resident KiB, /dev/shm names (of the
    run's session: tests in the other worker make segments of their own meanwhile)."""
    with open("/proc/self/maps") as f:
        mapped = sum(NAME_PREFIX in line for line in f)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "mapped": mapped, "rss_kib": rss,
            "dev_shm": len(leftover_segments(session_id))}


def _rank_main(rank: int, sc: dict) -> list:
    if sc.get("backend") == "nccl":
        torch.cuda.set_device(0)  # colocated: every rank on the one GPU
    session = _session(rank, sc)
    config = _config(sc)
    transport = IpcTransport(config, session, rank=rank, num_stages=P)
    try:
        if rank < P:
            return _run_sender(rank, transport, config, sc)
        return _run_receiver(rank, transport, config, sc)
    finally:
        transport.close()
        session.close()


def _die_handing_over(version: int, nth: int) -> None:
    """Make this process SIGKILL itself once its stage's `nth` bucket (0-based) of `version` is in its slot,
    before the header is posted (a stage source killed mid-handoff)."""
    original = IpcTransport._hand_over
    seen = [0]

    def dying(self, sequence, bucket, data, header):
        if header.result().version == version:
            seen[0] += 1
        if seen[0] == nth + 1:
            self.segments[self.rank].slot(sequence % 2)[: bucket.nbytes].copy_(data[: bucket.nbytes])
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, sequence, bucket, data, header)

    IpcTransport._hand_over = dying


def _run_sender(rank: int, transport: IpcTransport, config: WeightSyncConfig, sc: dict) -> list:
    from megatron_sync.transports.buckets.sender import WeightSender

    stream = FakeStream(rank, STAGES[rank], fail_at=tuple(sc.get("fail_at", ())) if rank == 1 else None)
    if sc.get("kill_source", {}).get("rank") == rank:
        _die_handing_over(sc["kill_source"]["version"], sc["kill_source"]["bucket"])
    sender = IpcTransport.make_sender(transport, stream, config, ())
    assert isinstance(sender, WeightSender)
    sender._corrupt_wire = wire_corruption(stream, sc.get("corrupt", ()))  # the test hook WeightSender offers
    log = []
    for v in sc["versions"]:
        stream.version = v
        with version_bound(sc, v, f"stage {rank}'s sync of version {v}"):
            try:
                metrics = sender.sync(v)
                log.append((v, "ok", metrics.bytes, metrics.media_bytes, _resources(sc["session"]), metrics.num_buckets))
            except SyncError as e:
                log.append((v, type(e).__name__, str(e)))
                if isinstance(e, PeerFailureError):
                    break
    return log


def _engine_matches(engine: FakeEngine) -> bool:
    """True when every shard the engine holds equals the reference slice of its version, bit for bit."""
    return all(torch.equal(engine.weights[m.name].cpu().view(-1).view(torch.uint8),
                           shard_rule(m, make_tensor(m, engine.version), engine.tp_rank, TP).contiguous()
                           .view(-1).view(torch.uint8))
               for m in ALL_METAS) if engine.version else not engine.weights


def _run_receiver(rank: int, transport: IpcTransport, config: WeightSyncConfig, sc: dict) -> list:
    engine = FakeEngine(ALL_METAS, rank - P, TP, die_after_shards=sc.get("die", {}).get(rank))
    receiver = transport.make_receiver(engine, config, ())
    log = []
    for v in sc["versions"]:
        with version_bound(sc, v, f"inference rank {rank - P}'s receive of version {v}"):
            try:
                m = receiver.receive(v)
                log.append((v, "ok", engine.version, _engine_matches(engine),
                            {"bytes": m.bytes, "copied": m.copied_bytes, "shard": m.shard_bytes,
                             "held": m.held_bytes, "staging": receiver.staging.nbytes, "media": m.media_bytes,
                             "buckets": m.num_buckets}, _resources(sc["session"])))
            except SyncError as e:
                log.append((v, type(e).__name__, engine.version, _engine_matches(engine), str(e)))
                if isinstance(e, PeerFailureError):
                    break
    return log


CLOSED = ("Connection was likely closed", "Connection reset by peer", "Broken pipe")
"""How the store's client words a store whose host has left (reading, reading mid-message, writing)."""


def _run(sc: dict, timeout: float = 120.0) -> dict:
    sc = {"port": free_port(), "timeout": 20.0, "session": new_session_id(), **sc}
    out = run_ranks(_rank_main, P + N, sc, timeout=timeout, init_group=False)
    assert leftover_segments(sc["session"]) == [], f"segments left in /dev/shm: {leftover_segments(sc['session'])}"
    return out


@pytest.mark.multiproc
def test_syncs_exact_then_a_flipped_shared_byte_and_a_failing_stage_abort_everywhere():
    """v1, v2 exact; v3 has a byte flipped in shared memory; v4's stage-1 stream fails; v5 recovers. Each
    receiver copies exactly its shard, holds only its two staging sets, and only control messages
    cross the store's socket (well under 1% of the bytes handed over in shared memory)."""
    out = _run({"versions": [1, 2, 3, 4, 5], "corrupt": (3, 1), "fail_at": (4, "model.norm.weight")})
    outcomes = ["ok", "ok", "SyncAbortedError", "SyncAbortedError", "ok"]
    for rank in range(P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert [entry[1] for entry in log] == outcomes, (rank, log)
        corrupt_msg, failure_msg = (log[2][4], log[3][4]) if rank >= P else (log[2][2], log[3][2])
        assert "CorruptBucketError" in corrupt_msg and "bucket 1 (stage 0" in corrupt_msg
        assert "fake conversion failure at model.norm.weight" in failure_msg
    for rank in range(P, P + N):
        log = out[rank][1]
        assert [entry[2:4] for entry in log] == [(1, True), (2, True), (2, True), (2, True), (5, True)]
        for entry in (log[0], log[1], log[4]):
            m = entry[4]
            assert m["copied"] == m["shard"] > 0 and m["held"] == m["staging"], m  # no receive buffers
            assert m["media"]["shm"] == m["bytes"] == sum(out[r][1][0][2] for r in range(P)), m
            assert 0 < m["media"]["socket"] < CONTROL_BYTES_PER_BUCKET * m["buckets"] + CONTROL_BYTES_PER_SYNC, m
    for rank in range(P):
        sent = out[rank][1][0]
        assert sent[3]["shm"] == sent[2], sent
        assert 0 < sent[3]["socket"] < CONTROL_BYTES_PER_BUCKET * sent[5] + CONTROL_BYTES_PER_SYNC, sent


@pytest.mark.multiproc
def test_twenty_versions_add_no_segment_handle_mapping_or_memory():
    """Every rank maps its segments once: after the first version, twenty syncs open no file descriptor,
    map nothing more, leave no name in /dev/shm, and resident memory stays where it was."""
    out = _run({"versions": list(range(1, 21))}, timeout=240.0)
    for rank in range(P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert [entry[1] for entry in log] == ["ok"] * 20, (rank, log)
        held = [entry[4 if rank < P else 5] for entry in log]
        print(f"rank {rank}: fds {[h['fds'] for h in held]}, rss KiB {[h['rss_kib'] for h in held]}")
        assert {h["mapped"] for h in held} == {1 if rank < P else P}, held  # its own, or every stage's
        assert {h["dev_shm"] for h in held} == {0}, held  # names unlinked once every rank mapped them
        assert max(h["fds"] for h in held) == held[0]["fds"], held  # (fewer once peers close their connections)
        growth = held[-1]["rss_kib"] - held[4]["rss_kib"]
        assert growth < RSS_SLACK_KIB, f"rank {rank} grew by {growth} KiB from version 5 to 20"
    for rank in range(P, P + N):
        assert all(entry[3] for entry in out[rank][1]), "a version was not exact"


@pytest.mark.multiproc
@pytest.mark.parametrize("victim", [0, 1], ids=["store-host", "other-stage"])
def test_a_stage_source_killed_mid_handoff_fails_every_survivor_within_timeout(victim):
    """Stage source `victim` is SIGKILLed with its second bucket of version 2 in its slot, unannounced. Every
    survivor reports a dead peer: the session's store went with the victim that hosted it; a victim that did
    not host it is named by the survivors' watch on their colocated peers (long before timeout_s), unless the
    store's host, a survivor too, noticed first and left with the store. A store host that finished version 1
    before the other stage's source had read its last agreement takes the store away mid-read: that source
    then fails in version 1, which every engine committed. The engines hold version 1 exactly, and nothing is left in /dev/shm (each segment's name went when every
    rank had mapped it)."""
    timeout = 60.0
    # every survivor's version 2 fails within timeout_s, else that rank fails
    out = _run({"versions": [1, 2], "timeout": timeout, "ends_within": {2: timeout},
                "kill_source": {"rank": victim, "version": 2, "bucket": 1}})
    assert out[victim] == ("exited", -signal.SIGKILL), out[victim]
    messages = []
    for rank in range(P, P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert log[0][1:4] == ("ok", 1, True)
        assert log[1][1:4] == ("PeerFailureError", 1, True), log[1]  # still version 1, bit for bit
        messages.append(log[1][4])
    survivor = 1 - victim
    status, log = out[survivor]
    assert status == "ok" and log[-1][1] == "PeerFailureError", (status, log)
    if len(log) == 1:  # the victim, which hosted the store, read the last gather of version 1 (every engine
        # committed it, above), went on and died while this slower rank was still reading it: the store went too
        assert victim == 0 and log[0][0] == 1 and any(closed in log[0][2] for closed in CLOSED), log
    else:
        assert len(log) == 2 and log[0][:2] == (1, "ok"), log
    messages.append(log[-1][2])
    if victim == 1:  # the first survivor to notice names it from its watch (stage 0's source, hosting the store,
        # often: the engines then find the store gone, whichever watch had not fired yet)
        assert any("transport rank 1 (pid" in m and "died while this rank waited" in m for m in messages), messages
        assert all("transport rank 1 (pid" in m or any(closed in m for closed in CLOSED) for m in messages), messages


@pytest.mark.multiproc
def test_an_engine_rank_killed_mid_apply_fails_the_trainer_within_timeout_and_the_survivor_keeps_its_version():
    """Engine rank 3 exits while copying its regions of version 2: every survivor reports a dead peer long
    before timeout_s (whoever waits for rank 3 names it, from its watch on colocated peers; a rank that
    learns of it later finds the store's host, stage 0's source, gone with the failure); the surviving
    engine rank holds version 1 exactly."""
    timeout = 60.0
    die_after = len(ALL_METAS) + 3  # dies while staging version 2
    # every survivor's version 2 fails within timeout_s, else that rank fails
    out = _run({"versions": [1, 2], "die": {3: die_after}, "timeout": timeout, "ends_within": {2: timeout}})
    assert out[3] == ("exited", 17), out[3]
    messages = []
    for rank in range(P):
        status, log = out[rank]
        assert status == "ok", log
        assert log[0][1] == "ok" and log[1][1] == "PeerFailureError", log
        messages.append(log[1][2])
    status, log = out[2]
    assert status == "ok", log
    assert log[1][1:4] == ("PeerFailureError", 1, True), log[1]
    messages.append(log[1][4])
    assert any("transport rank 3 (pid" in m and "died while this rank waited" in m for m in messages), messages
    # the others name the dead rank too, or the connection it (or a rank that left after it) closed, whichever
    # their wait (or post: a broken pipe) noticed first under load
    assert all("transport rank 3 (pid" in m or any(closed in m for closed in CLOSED) for m in messages), messages


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_segments_hand_buckets_over_on_one_gpu():
    """backend nccl: each stage source shares one device buffer through one CUDA IPC handle for the run; the
    engine ranks on the same GPU open it once; shards exact, a byte flipped in the device buffer caught."""
    out = _run({"versions": [1, 2, 3], "backend": "nccl", "corrupt": (2, 1)})
    for rank in range(P, P + N):
        status, log = out[rank]
        assert status == "ok", (rank, log)
        assert [entry[1:4] for entry in log] == [("ok", 1, True), ("SyncAbortedError", 1, True), ("ok", 3, True)]
        assert log[0][4]["copied"] == log[0][4]["shard"] and log[0][4]["media"]["shm"] == log[0][4]["bytes"]
