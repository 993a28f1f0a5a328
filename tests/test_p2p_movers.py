"""The P2P data path on loopback with real processes, below the drivers: the bytes that arrive are the bytes sent.

Two trainer ranks hold the seeded full tensors of a tiny MoE model and write their scheduled pieces from
their arenas (`ShareWriter`); five inference ranks (a reference engine at TP=1, and two engines fusing their
params at TP=2 as vLLM does, the second chained behind the first) receive round by round (`RoundReceiver`)
into staging filled with a sentinel byte. Each backend (NIXL over UCX's TCP transport, Mooncake over TCP,
torch.distributed over gloo) moves one version; every receiver then checks its shards against the full
tensors, that no byte outside its placements changed, and the bytes counted against its shard bytes; the
trainer ranks' egress is one copy per layout. Once with the staging set as the window, once with bounded
windows and arenas (rounds, releases, arena reuse). Faults: a corrupted piece, a sender failing mid-walk, a
sender that stays silent: every receiver waiting for it raises a clear error within its bound. A relay
corrupted on its way between two ranks of one engine is caught by the rank it lands in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

from megatron_sync.transports.p2p.movers.nixl import NIXL_MODULES
from tests.p2p_support import SENTINEL, fusing, misplaced, ref, schedule_of, seeded_full, untouched_outside_placements
from tests.support.dist import free_port, run_distributed
from tests.support.timing import bounded

SENDERS = 2
ENGINES = [ref(1), fusing(2), fusing(2)]
BACKENDS = ("nixl", "mooncake", "torch")
RECEIVE_TIMEOUT_S = 5
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # NIXL over real sockets, not shared memory


def _schedule(**options):
    return schedule_of("qwen3_moe", ENGINES, dict(tp=SENDERS), piece_bytes=4096, **options)


def _mover(backend, group, world):
    from megatron_sync.transports.p2p.notices import receiver, trainer

    if backend == "nixl":
        from megatron_sync.transports.p2p.movers.nixl import NixlMover
        return NixlMover(group.board, timeout_s=group.timeout_s, device=group.device)
    if backend == "mooncake":
        from megatron_sync.transports.p2p.movers.mooncake import MooncakeMover
        return MooncakeMover(group.board, protocol="tcp", timeout_s=group.timeout_s, device=group.device)
    from megatron_sync.transports.p2p.movers.torch_p2p import TorchMover
    names = {trainer(s): s for s in range(SENDERS)}
    names.update({receiver(i): SENDERS + i for i in range(world - SENDERS)})
    return TorchMover(group, names)


def _open_group(rank, world, port):
    from megatron_sync.session.group import init_transport_group

    return init_transport_group("127.0.0.1", port, world, rank, timeout=60, group_name="p2p_path")


def _send(rank, planned, mover, notices, fault=None, offsets=None):
    from megatron_sync.transports.p2p.writer import ShareWriter

    specs, schedule = planned
    arena = mover.alloc(max(schedule.arena_bytes(rank), 1))
    writer = ShareWriter(schedule, rank, mover, arena, algorithm="xxh3", timeout_s=RECEIVE_TIMEOUT_S)
    names = list(dict.fromkeys(p.name for p in writer.queue))  # walk order
    by_name = {s.name: s for s in specs}

    def tensors():
        for k, name in enumerate(names):
            if fault == "failing" and k == len(names) // 2:
                raise KeyError(f"injected: {name} was not converted")
            yield name, seeded_full(by_name[name])

    if fault == "silent":
        return {"silent": True}
    if fault == "corrupt":
        writer.mover = _Corrupting(mover)
    return {"sent": writer.write_version(tensors(), notices, offsets if offsets is not None else {}).nbytes}


def _receive(index, planned, mover, notices, corrupting=False, base=0):
    from megatron_sync.transports.p2p.notices import receiver
    from megatron_sync.transports.p2p.rounds import RoundReceiver

    specs, schedule = planned
    layout = schedule.receivers[index].layout
    memory = mover.alloc(base + layout.nbytes)  # `base` bytes before the staging set: where it starts
    memory.fill_(SENTINEL)
    staging = memory[base:]
    bounded_window = bool(schedule.options.window_bytes)
    window = mover.alloc(schedule.window_bytes(index)) if bounded_window else memory
    mover.expose(receiver(index), window)
    rounds = RoundReceiver(schedule, index, mover, window, algorithm="xxh3", timeout_s=RECEIVE_TIMEOUT_S)
    if corrupting:  # what this rank writes (its relays, its forwards) arrives with a byte flipped
        rounds.mover = _CorruptingOnTheWire(mover)
    notices.board.post(f"exposed/{notices.version}/{index}", b"1")  # every window is up before anyone writes
    stats = rounds.receive_version(notices, staging, base)
    return {"wrong": misplaced(layout, staging, specs), "clean": untouched_outside_placements(layout, staging),
            "before_untouched": bool((memory[:base] == SENTINEL).all()),
            "received": stats.nbytes, "forwarded": stats.forwarded, "shard_bytes": layout.shard_bytes}


def _one_version(rank, world, planned, backend, group, version, fault=None, corrupting=None):
    from megatron_sync.transports.p2p.notices import Notices

    mover = _mover(backend, group, world)
    notices = Notices(group.board, version, 1)
    try:
        if rank < SENDERS:
            for index in range(world - SENDERS):
                group.board.fetch(f"exposed/{version}/{index}", 60)
            return _send(rank, planned, mover, notices, fault if rank == 0 else None)
        return _receive(rank - SENDERS, planned, mover, notices, rank - SENDERS == corrupting)
    finally:
        _store_barrier(group, rank, world, f"end/{version}")  # nobody closes a window someone still writes
        mover.close()


def _every_backend(rank, world, port, planned):
    group = _open_group(rank, world, port)
    out = {b: _one_version(rank, world, planned, b, group, v) for v, b in enumerate(BACKENDS, start=1)}
    _leave(group, rank, world)
    return out


def _store_barrier(group, rank, world, key, ranks=None):
    """Post `key/rank` and wait until every rank of `ranks` (default: all) posted theirs, over the store."""
    group.board.post(f"{key}/{rank}", b"1")
    for other in ranks if ranks is not None else range(world):
        group.board.fetch(f"{key}/{other}", 60)


def _leave(group, rank, world):
    if rank:
        group.board.post(f"left/{rank}", b"1")
    else:  # rank 0 hosts the store: it leaves last
        _store_barrier(group, rank, world, "left", ranks=range(1, world))
    group.close()


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("options", [{}, {"window_bytes": 6000, "arena_bytes": 8192}],
                         ids=["staging-window", "bounded"])
def test_every_receiver_gets_exactly_its_shards_over_every_backend(options):
    planned = _schedule(**options)  # pure; workers get it pickled
    schedule = planned[1]
    world = SENDERS + len(schedule.receivers)
    results = run_distributed(_every_backend, world, free_port(), planned, timeout=300, env=UCX_TCP)
    for backend in BACKENDS:
        receivers = [r[backend] for r in results[SENDERS:]]
        for index, got in enumerate(receivers):
            assert got["wrong"] == [], f"{backend} receiver {index}: wrong shards {got['wrong'][:5]}"
            assert got["clean"], f"{backend} receiver {index}: bytes outside its shards were written"
            assert got["received"] == got["shard_bytes"], (backend, index, got["received"], got["shard_bytes"])
        sent = [results[s][backend]["sent"] for s in range(SENDERS)]
        assert sent == [schedule.bytes_from_sender()[s] for s in range(SENDERS)]
        assert sum(sent) == schedule.trainer_egress() < sum(r["shard_bytes"] for r in receivers)
        assert [r["forwarded"] for r in receivers] == [schedule.forwarded_bytes()[i] for i in range(len(receivers))]
    if options:
        assert max(schedule.rounds) > 1 and max(len({p.arena_round for p in schedule.sender_queue(s)})
                                                for s in range(SENDERS)) > 1


def _posted_bases(rank, world, port, planned):
    """One version over NIXL into receivers whose staging set starts a set's length into the window they expose
    (posted as `Notices.post_base`); the trainer ranks write where each receiver posted (`PostedBases`)."""
    from megatron_sync.transports.p2p.notices import Notices, PostedBases

    group = _open_group(rank, world, port)
    mover = _mover("nixl", group, world)
    notices = Notices(group.board, 1, 1)
    try:
        if rank < SENDERS:
            for index in range(world - SENDERS):
                group.board.fetch(f"exposed/1/{index}", 60)
            return _send(rank, planned, mover, notices, offsets=PostedBases(notices, RECEIVE_TIMEOUT_S))
        index = rank - SENDERS
        return _receive(index, planned, mover, notices, base=planned[1].receivers[index].layout.nbytes)
    finally:
        _store_barrier(group, rank, world, "end/1")
        mover.close()
        _leave(group, rank, world)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_with_one_staging_set_every_writer_writes_where_its_receiver_posted_its_set():
    # One staging set holds the live version until the receiver's host copy of it is done, so the receiver
    # posts where its set starts once it may be written, and the trainer ranks write only there. The set here
    # starts a set's length into the window (as in a receiver with two sets), which no writer can compute
    # itself: exact shards there, and nothing before them, show every write waited for the posted base.
    planned = _schedule(staging_sets=1)
    schedule = planned[1]
    assert schedule.options.posts_base and not _schedule()[1].options.posts_base
    world = SENDERS + len(schedule.receivers)
    results = run_distributed(_posted_bases, world, free_port(), planned, timeout=240, env=UCX_TCP)
    for index, got in enumerate(results[SENDERS:]):
        assert got["wrong"] == [], f"receiver {index}: wrong shards {got['wrong'][:5]}"
        assert got["clean"] and got["before_untouched"], (index, got)
        assert got["received"] == got["shard_bytes"], (index, got)
    assert sum(results[s]["sent"] for s in range(SENDERS)) == schedule.trainer_egress()


FAULTS = {  # fault -> (error every waiting receiver raises, words in it); silent goes last: it breaks gloo pairs
    "corrupt": ("CorruptBucketError", "does not match its checksum"),
    "failing": ("SenderFailedError", "injected: "),  # the sender fails mid-walk; its error reaches them
    "silent": ("PeerFailureError", "within"),  # the sender never writes: a bounded wait
}


class _Corrupting:
    """A mover that flips the first byte it writes of every batch, after its checksum was taken."""

    def __init__(self, mover):
        self._mover = mover

    def __getattr__(self, name):
        return getattr(self._mover, name)

    def write(self, target, memory, spans):
        memory[spans[0].src] ^= 0xFF
        return self._mover.write(target, memory, spans)


class _CorruptingOnTheWire(_Corrupting):
    """A mover whose writes arrive with the first byte of every batch flipped; the memory written from keeps
    its bytes (flipped back once the write completed)."""

    def write(self, target, memory, spans):
        from megatron_sync.transports.p2p.movers import Done

        try:
            super().write(target, memory, spans).wait(RECEIVE_TIMEOUT_S)
        finally:
            memory[spans[0].src] ^= 0xFF
        return Done()


def _corrupt_relays(rank, world, port, planned, owner):
    """One version in which inference rank `owner` relays (and forwards) with a byte flipped on the wire."""
    from megatron_sync.core.errors import SyncError

    group = _open_group(rank, world, port)
    try:
        result = _one_version(rank, world, planned, "nixl", group, 1, corrupting=owner)
    except SyncError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    _leave(group, rank, world)
    return result


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_relay_corrupted_between_two_ranks_of_an_engine_is_caught_where_it_lands():
    planned = _schedule()
    schedule = planned[1]
    owner = next(i for i, n in schedule.relayed_bytes().items() if n)
    peers = {p.receiver for p in schedule.relays if p.via == owner}
    assert peers
    results = run_distributed(_corrupt_relays, SENDERS + len(schedule.receivers), free_port(), planned, owner,
                              timeout=200, env=UCX_TCP)
    mine = results[SENDERS + owner]
    assert "error" not in mine and not mine["wrong"], mine  # it checked what it received; its own copy is intact
    for peer in peers:
        got = results[SENDERS + peer]
        assert got.get("error") == "CorruptBucketError" and "does not match its checksum" in got["message"], got
        assert f"relayed by inference rank {owner})" in got["message"], got


def _faulty_sender(rank, world, port, planned, backend):
    """One version per fault, in FAULTS order; trainer rank 0 misbehaves."""
    from megatron_sync.core.errors import SyncError

    schedule = planned[1]
    group = _open_group(rank, world, port)
    waiting = _waiting_on_rank0(schedule)
    results = {}
    for version, fault in enumerate(FAULTS, start=1):
        # a receiver waiting for trainer rank 0 gives up within its receive timeout (+3 s), else it fails
        bound = (bounded(RECEIVE_TIMEOUT_S + 3, f"{fault}: receiver {rank - SENDERS} waiting for trainer rank 0")
                 if rank - SENDERS in waiting else contextlib.nullcontext())
        with bound:
            try:
                results[fault] = _one_version(rank, world, planned, backend, group, version, fault)
            except (SyncError, KeyError) as e:
                results[fault] = {"error": type(e).__name__, "message": str(e)}
    _leave(group, rank, world)
    return results


def _waiting_on_rank0(schedule):
    """Return the receivers that wait for trainer rank 0 (directly, or chained behind one that does)."""
    heads = {p.receiver for p in schedule.pieces if p.sender == 0}
    return {i for i in range(len(schedule.receivers)) if schedule.head_of(i) in heads}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_faults_reach_every_waiting_receiver_as_clear_errors(backend):
    planned = _schedule()
    schedule = planned[1]
    results = run_distributed(_faulty_sender, SENDERS + len(schedule.receivers), free_port(), planned, backend,
                              timeout=200, env=UCX_TCP)
    waiting = _waiting_on_rank0(schedule)
    assert waiting and any(schedule.feeds[i] != -1 for i in waiting), "a chained receiver must wait on rank 0 too"
    for fault, (error, words) in FAULTS.items():
        for index in waiting:  # a chained receiver gets the error of the rank before it, quoted
            got = results[SENDERS + index][fault]
            want = {error} if schedule.feeds[index] == -1 else {"SenderFailedError"}
            if fault == "silent" and schedule.feeds[index] != -1:  # both wait as long: either may time out first
                want.add("PeerFailureError")
            assert got.get("error") in want and words in got["message"], (fault, index, got)


def test_mooncake_refuses_rdma_without_a_device_and_unregistered_sources():
    from megatron_sync.transports.p2p.movers import Span
    from megatron_sync.transports.p2p.movers.mooncake import MooncakeMover

    class Posts(dict):
        timeout_s = 5

        def post(self, key, value):
            self[key] = value

        def fetch(self, key, timeout_s=None):
            return self[key]

    with pytest.raises(RuntimeError, match="no RDMA device"):
        MooncakeMover(Posts(), protocol="rdma")
    mover = MooncakeMover(Posts(), protocol="tcp")
    window = mover.alloc(4096)
    window.zero_()
    mover.expose("receiver/0", window)
    with pytest.raises(ValueError, match="is not registered"):
        mover.write("receiver/0", torch.zeros(64, dtype=torch.uint8), [Span(0, 0, 64)])
    with pytest.raises(ValueError, match="land outside the peer's 4096-byte window"):
        mover.write("receiver/0", mover.alloc(64), [Span(0, 4090, 64)])
    source = mover.alloc(64)
    source.fill_(7)
    mover.write("receiver/0", source, [Span(0, 100, 32), Span(32, 132, 32)]).wait(5)  # lands in our own window
    assert bool((window[100:164] == 7).all()) and int(window[:100].sum()) == 0
    assert mover.bytes_written == {"receiver/0": 64}
    assert mover.write("receiver/0", source, []).done()  # nothing to write (an empty round) is done at once
    mover.close()


@pytest.mark.parametrize("topology,count", [("", 0), ('{"cpu:0": [[], []]}', 0),
                                            ('{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}', 2)])
def test_count_hcas(topology, count):
    from megatron_sync.transports.p2p.movers.mooncake import count_hcas

    assert count_hcas(topology) == count


def _nccl_and_vram(rank, world, port, planned, backend):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from megatron_sync.session.group import init_transport_group

    backend_group = "nccl" if backend == "torch" else "gloo"
    group = init_transport_group("127.0.0.1", port, world, rank, backend=backend_group, timeout=60,
                                 group_name="p2p_gpu")
    if backend == "nixl":  # device memory on both sides: NIXL registers VRAM
        group.device = torch.device("cuda", torch.cuda.current_device())
    out = _one_version(rank, world, planned, backend, group, 1)
    _leave(group, rank, world)
    return out


WORLD = SENDERS + 1 + 2 + 2
"""The processes of a version of `_schedule()`: the trainer ranks and every rank of ENGINES."""
NCCL_GPUS = pytest.mark.skipif(torch.cuda.device_count() < WORLD,
                               reason=f"NCCL refuses two ranks on one device: needs {WORLD} GPUs")
NIXL_BUILD = pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in NIXL_MODULES),
                                reason="no NIXL build for this host's CUDA (make gpu-wheels fetches nixl-cu13)")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=NCCL_GPUS), pytest.param("nixl", marks=NIXL_BUILD)])
def test_device_memory_moves_the_same_bytes(backend):
    """On CUDA: NCCL point-to-point (a GPU per rank), or NIXL from a GPU arena into GPU windows (VRAM
    registration; every rank may share one GPU)."""
    planned = _schedule()
    world = SENDERS + len(planned[1].receivers)
    assert world == WORLD, (world, WORLD)
    results = run_distributed(_nccl_and_vram, world, free_port(), planned, backend, timeout=240,
                              env={**UCX_TCP, "UCX_TLS": os.environ.get("UCX_TLS", "all")})
    for got in results[SENDERS:]:
        assert got["wrong"] == [] and got["received"] == got["shard_bytes"]


def test_nixl_is_found_in_the_cuda_13_build_a_gpu_machine_gets(tmp_path, monkeypatch):
    """A lent GPU machine (CUDA 13) gets the nixl-cu13 wheel alone, whose module is `nixl_cu13`: the NIXL
    mover finds it there, before the nixl-cu12 installed here; with no build at all, the error names the fix."""
    import sys

    from megatron_sync.transports.p2p.movers import nixl

    build = tmp_path / "nixl_cu13"
    build.mkdir()
    (build / "__init__.py").write_text("")
    (build / "_api.py").write_text("BUILD = 'cu13'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert nixl.nixl_api().BUILD == "cu13"
    finally:  # later tests find the real build again
        for name in ("nixl_cu13._api", "nixl_cu13"):
            sys.modules.pop(name, None)
    monkeypatch.setattr(nixl, "NIXL_MODULES", ("no_nixl_build_here",))
    with pytest.raises(ImportError, match=r"no_nixl_build_here.*install the build of this host's CUDA"):
        nixl.nixl_api()


def test_nixl_progress_thread_waits_on_events_instead_of_spinning():
    """NIXL's Python agent pins its progress thread's poll() timeout to 0 (a core per engine rank); inside
    `_progress_wake` the bindings' config keeps at least the wake interval, outside NIXL's own value stands."""
    from megatron_sync.transports.p2p.movers.nixl import _progress_wake, nixl_api

    nixlBind = nixl_api().nixlBind  # a requirement (requirements-cpu.txt): missing is a failure

    def delay_after_nixl_sets_it():
        config = nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what nixl_agent.__init__ does
        return config.pthrDelay

    with _progress_wake(2.5):
        assert delay_after_nixl_sets_it() == 2500
    with _progress_wake(0):
        assert delay_after_nixl_sets_it() == 0
    assert delay_after_nixl_sets_it() == 0 and nixlBind.nixlAgentConfig.__name__ == "nixlAgentConfig"
