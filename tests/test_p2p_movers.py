"""Byte movers on loopback with real processes: the bytes that arrive are the bytes that were sent.

Two senders hold the full tensors of a tiny model; three receivers (a reference engine at
TP=1 and an engine fusing its params at TP=2, as vLLM does) start from a staging buffer filled with a sentinel
byte. Each backend moves one version; every receiver then checks its shards against the
full tensors, that no byte outside its placements changed, and the bytes counted at the
transport against its shard bytes.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tests.support.dist import free_port, run_distributed
from tests.support.timing import bounded
from tests.p2p_support import SENTINEL, fusing, misplaced, ref, seeded_full, synthetic_plan, untouched_outside_placements

SENDERS = 2
RECEIVE_TIMEOUT_S = 5
BACKENDS = ("torch", "mooncake")


def _plan(bucket=4096):
    return synthetic_plan("qwen3_moe", [ref(1), fusing(2)], SENDERS, bucket)


def _mover(backend, group, plan):
    from megatron_sync.transports.p2p.movers import MooncakeMover, TorchP2PMover

    if backend == "mooncake":
        return MooncakeMover(group.board, protocol="tcp", timeout_s=group.timeout_s)
    peers = {("sender", s): s for s in range(SENDERS)}
    peers.update({("receiver", i): SENDERS + i for i in range(len(plan.receivers))})
    return TorchP2PMover(group, peers)


def _open_group(rank, world, port, timeout):
    from megatron_sync.session.group import init_transport_group

    return init_transport_group("127.0.0.1", port, world, rank, timeout=timeout, group_name="p2p_test")


def _sync_once(rank, plan, specs, holders, mover, group, version, *, sender_fault=None, timeout_s=None):
    """One version over one mover; returns the receiver's findings, or the sender's stats."""
    from megatron_sync.transports.p2p.execute import receive_shards, send_share

    if rank < SENDERS:
        replica = {s.name: seeded_full(s) for s in specs if holders[s.name] == rank}
        if sender_fault == "missing" and rank == 0:
            replica.pop(next(iter(replica)))
        if sender_fault == "silent" and rank == 0:
            return {"silent": True}
        stats = send_share(plan, rank, replica, mover, group.board, version=version)
        return {"sent": stats.nbytes}
    index = rank - SENDERS
    layout = plan.receivers[index].layout
    staging = torch.full((layout.nbytes,), SENTINEL, dtype=torch.uint8)
    mover.expose(index, staging)
    stats = receive_shards(plan, index, staging, mover, group.board, version=version,
                           timeout_s=timeout_s or group.timeout_s)
    return {"wrong": misplaced(layout, staging, specs), "clean": untouched_outside_placements(layout, staging),
            "received": stats.nbytes, "shard_bytes": layout.shard_bytes, "ranges": stats.ranges}


def _both_backends(rank, world, port, planned):
    specs, _, holders, plan = planned
    group = _open_group(rank, world, port, timeout=60)
    out = {}
    for version, backend in enumerate(BACKENDS, start=1):
        mover = _mover(backend, group, plan)
        out[backend] = _sync_once(rank, plan, specs, holders, mover, group, version)
        group.all_gather_json(rank)  # stands in for the all-ranks agreement; rank 0 hosts the store
        mover.close()
    group.close()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket", [4096, 1 << 20])
def test_every_receiver_gets_exactly_its_shards_over_both_backends(bucket):
    import mooncake.engine  # noqa: F401 — a requirement (requirements-cpu.txt): missing is a failure
    planned = _plan(bucket)  # pure; workers get it pickled and skip importing transformers
    world = SENDERS + len(planned[1])
    results = run_distributed(_both_backends, world, free_port(), planned, timeout=240)
    for backend in BACKENDS:
        sent = sum(results[s][backend]["sent"] for s in range(SENDERS))
        receivers = [r[backend] for r in results[SENDERS:]]
        for index, got in enumerate(receivers):
            assert got["wrong"] == [], f"{backend} receiver {index}: wrong shards {got['wrong'][:5]}"
            assert got["clean"], f"{backend} receiver {index}: bytes outside its shards were written"
            assert got["received"] == got["shard_bytes"], (backend, index, got["received"], got["shard_bytes"])
        assert sent == sum(r["shard_bytes"] for r in receivers)


FAULTS = {  # fault -> (error every waiting receiver raises, words in it); silent goes last: it breaks gloo pairs
    "corrupt": ("CorruptBucketError", "does not match its checksum"),
    "missing": ("SenderFailedError", "trainer rank 0: KeyError"),  # the sender fails; its error reaches them
    "silent": ("PeerFailureError", "within"),  # the sender never sends: a bounded wait
}


def _faulty_sender(rank, world, port, planned, backend):
    """One version per fault, in FAULTS order, on one group; trainer rank 0 misbehaves."""
    from megatron_sync.core.errors import SyncError

    specs, _, holders, plan = planned
    group = _open_group(rank, world, port, timeout=60)
    waiting = {SENDERS + m.receiver for m in plan.messages if m.sender == 0}
    results = {}
    for version, fault in enumerate(FAULTS, start=1):
        mover = _mover(backend, group, plan)
        if fault == "corrupt" and rank == 0:
            mover = _Corrupting(mover)
        # a receiver waiting for trainer rank 0 gives up within its receive timeout (+3 s), else it fails
        bound = (bounded(RECEIVE_TIMEOUT_S + 3, f"{fault}: receiver {rank - SENDERS} waiting for trainer rank 0")
                 if rank in waiting else contextlib.nullcontext())
        with bound:
            try:
                results[fault] = _sync_once(rank, plan, specs, holders, mover, group, version, sender_fault=fault,
                                            timeout_s=RECEIVE_TIMEOUT_S)
            except (SyncError, KeyError) as e:
                results[fault] = {"error": type(e).__name__, "message": str(e)}
        _store_barrier(group, rank, world, f"end/{version}")  # a gloo op that timed out closes its pair
    if rank:
        group.board.post(f"left/{rank}", b"1")
    else:  # rank 0 hosts the store: it leaves last
        _store_barrier(group, rank, world, "left", ranks=range(1, world))
    return results


def _store_barrier(group, rank, world, key, ranks=None):
    """Post `key/rank` and wait until every rank of `ranks` (default: all) posted theirs, over the store."""
    group.board.post(f"{key}/{rank}", b"1")
    for other in ranks if ranks is not None else range(world):
        group.board.fetch(f"{key}/{other}", 60)


class _Corrupting:
    """A mover that flips one byte of every payload after its checksums were taken."""

    def __init__(self, mover):
        self._mover = mover

    def __getattr__(self, name):
        return getattr(self._mover, name)

    def write(self, message, ranges, payload, set_offset=0):
        payload[0] ^= 0xFF
        self._mover.write(message, ranges, payload, set_offset)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_faults_reach_every_waiting_receiver_as_clear_errors(backend):
    if backend == "mooncake":
        import mooncake.engine  # noqa: F401 — a requirement (requirements-cpu.txt): missing is a failure
    planned = _plan()
    plan = planned[3]
    results = run_distributed(_faulty_sender, SENDERS + len(plan.receivers), free_port(), planned, backend,
                              timeout=200)
    waiting = {m.receiver for m in plan.messages if m.sender == 0}
    assert waiting
    for fault, (error, words) in FAULTS.items():
        for index in waiting:
            got = results[SENDERS + index][fault]
            assert got.get("error") == error and words in got["message"], (fault, index, got)


def test_mooncake_refuses_rdma_without_a_device_and_unregistered_sources():
    import mooncake.engine  # noqa: F401 — a requirement (requirements-cpu.txt): missing is a failure
    from megatron_sync.transports.p2p.movers import MooncakeMover

    class Posts(dict):
        def post(self, key, value):
            self[key] = value

        def fetch(self, key, timeout_s=None):
            return self[key]

        def delete(self, key):
            del self[key]

    with pytest.raises(RuntimeError, match="no RDMA device"):
        MooncakeMover(Posts(), protocol="rdma")
    _, _, _, plan = _plan()
    mover = MooncakeMover(Posts(), protocol="tcp")
    staging = torch.zeros(plan.receivers[0].layout.nbytes, dtype=torch.uint8)
    mover.expose(0, staging)
    message = next(m for m in plan.messages if m.receiver == 0)
    unregistered = torch.zeros(message.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not in a registered buffer"):
        mover.write(message, plan.ranges, unregistered)
    payload = mover.send_buffer(message.nbytes)[:message.nbytes]
    payload.fill_(7)
    mover.write(message, plan.ranges, payload)  # registered: lands in our own staging over TCP
    first = plan.ranges[message.ranges[0]]
    assert bool((staging[first.dst:first.dst + first.nbytes] == 7).all())
    assert mover.bytes_written == {0: message.nbytes}
    mover.close()


@pytest.mark.parametrize("topology,count", [
    ("", 0),
    (json.dumps({"cpu:0": [[], []]}), 0),
    (json.dumps({"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}), 2),
])
def test_count_hcas(topology, count):
    from megatron_sync.transports.p2p.movers import count_hcas

    assert count_hcas(topology) == count


def _nccl_worker(rank, world, port, planned):
    from megatron_sync.transports.p2p.execute import receive_shards, send_share
    from megatron_sync.transports.p2p.movers import TorchP2PMover
    from megatron_sync.session.group import init_transport_group

    torch.cuda.set_device(rank % torch.cuda.device_count())
    specs, _, holders, plan = planned
    group = init_transport_group("127.0.0.1", port, world, rank, backend="nccl", timeout=60, group_name="p2p_nccl")
    peers = {("sender", s): s for s in range(SENDERS)}
    peers.update({("receiver", i): SENDERS + i for i in range(len(plan.receivers))})
    mover = TorchP2PMover(group, peers)
    if rank < SENDERS:
        replica = {s.name: seeded_full(s).cuda() for s in specs if holders[s.name] == rank}
        return send_share(plan, rank, replica, mover, group.board, version=1).nbytes
    layout = plan.receivers[rank - SENDERS].layout
    staging = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
    stats = receive_shards(plan, rank - SENDERS, staging, mover, group.board, version=1, timeout_s=60)
    return not misplaced(layout, staging, specs) and stats.nbytes == layout.shard_bytes


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_nccl_point_to_point_moves_the_same_bytes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    planned = _plan()
    results = run_distributed(_nccl_worker, SENDERS + len(planned[1]), free_port(), planned, timeout=240)
    assert all(results[SENDERS:])
