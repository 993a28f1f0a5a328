"""The transport group: a process group over a rendezvous store, with timeout-bounded collectives.

The group joins the ranks a transport needs (for broadcast: the P stage
source ranks, group ranks 0..P-1, then the N inference ranks P..P+N-1). It is
built over the store of a sync session (`session.py`: the rendezvous and its
join handshake) under a prefix unique to the session, so separately launched
jobs can join it and nobody else can, and it never touches (or is registered
as) the training job's default group: collectives are called on the backend object itself, and
each is bounded by `timeout_s`. The store also carries small control data
(`post` / `fetch`), which the control channel builds on.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.session.rendezvous import Identity
from megatron_sync.session.session import SyncSession
from megatron_sync.session.board import Board, store_board
from megatron_sync.session.shards import NoticeShards

INLINE_JSON = 248
"""Bytes of JSON a rank's part of `all_gather_json` carries in the first collective (with its 8-byte length:
256 bytes a rank); a longer one takes a second."""


class TransportGroup:
    """A process group over a rendezvous store, with timeout-bounded collectives."""

    def __init__(self, backend_pg: Any, store: Any, *, rank: int, world_size: int,
                 backend: str, timeout_s: float, group_name: str) -> None:
        self._pg, self._store = backend_pg, store
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_s, self.group_name = backend, timeout_s, group_name
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.board = store_board(store, prefix=f"{group_name}/post/", rank=rank, timeout_s=timeout_s,
                                failure=self._fail)
        self._blocking: Optional[Board] = None
        self._shards: dict[str, NoticeShards] = {}  # by group name: this group's, and others' this rank reports on
        self._owned_session: Any = None

    def control_board(self) -> Board:
        """Return a board of the same keys as `board` whose waits block in the store's own wait (a control
        message is taken the moment it is posted; `board.PolledStore` blocking), made once."""
        if self._blocking is None:
            self._blocking = store_board(self._store, prefix=f"{self.group_name}/post/", rank=self.rank,
                                         timeout_s=self.timeout_s, failure=self._fail, blocking=True)
        return self._blocking

    def notice_shards(self, count: int, *, of: Optional[str] = None) -> NoticeShards:
        """Return the group's `count` notice stores (`session/shards.py`), hosted by rank 0, or those of the group
        named `of` over the same store (hosted by its rank 0); each made once, closed with this group."""
        name = of or self.group_name
        if name not in self._shards:
            self._shards[name] = NoticeShards(self, count, of=None if name == self.group_name else name)
        if self._shards[name].count != count:
            raise ValueError(f"the notice stores of group {name!r} are {self._shards[name].count}, not {count}")
        return self._shards[name]

    def close_notice_shards(self, of: str) -> None:
        """Close this rank's boards on the notice stores of the group named `of` (one it will not report on
        again: a fleet engine's earlier link)."""
        shards = self._shards.pop(of, None)
        if shards is not None:
            shards.close()

    @property
    def store_client(self) -> Any:
        """This rank's bounded client of the group's store."""
        return self._store

    @property
    def store_host(self) -> str:
        """The address the group's store is reached at."""
        return self._store.raw.host

    def failure(self, op: str, error: BaseException) -> PeerFailureError:
        """Word a store error of this group (`op` failed) as a PeerFailureError."""
        return self._fail(op, error)

    def owns(self, session: Any) -> None:
        """Close `session` with this group (a bare group that hosted or joined its own)."""
        self._owned_session = session

    def _fail(self, op: str, error: BaseException) -> PeerFailureError:
        return PeerFailureError(
            f"[transport rank {self.rank}] {op} on group {self.group_name!r} failed or timed out "
            f"(timeout {self.timeout_s:g}s); expected transport ranks 0..{self.world_size - 1} "
            f"to take part: {error}"
        )

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> "PendingOp":
        """Broadcast `tensor` in place from group rank `src`; return a handle (already waited unless async)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        try:
            pending = PendingOp(self, f"broadcast from rank {src}", self._backend().broadcast([tensor], opts))
        except RuntimeError as e:
            raise self._fail(f"broadcast from rank {src}", e) from e
        if not async_op:
            pending.wait()
        return pending

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> "PendingOp":
        """Start sending `tensor` to group rank `dst`; return the in-flight handle (bounded `wait`)."""
        try:
            return PendingOp(self, f"send to rank {dst}", self._backend().send([tensor], dst, tag))
        except RuntimeError as e:
            raise self._fail(f"send to rank {dst}", e) from e

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> "PendingOp":
        """Start receiving into `tensor` from group rank `src`; return the in-flight handle (bounded `wait`)."""
        try:
            return PendingOp(self, f"receive from rank {src}", self._backend().recv([tensor], src, tag))
        except RuntimeError as e:
            raise self._fail(f"receive from rank {src}", e) from e

    def _all_gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's `mine` (same shape on every rank), indexed by rank."""
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = self._backend().allgather([out], [mine])
        except RuntimeError as e:
            raise self._fail("all_gather", e) from e
        PendingOp(self, "all_gather", work).wait()
        return out

    def all_gather_int64(self, values: Sequence[int]) -> list[list[int]]:
        """Return every rank's `values` (same length on every rank), indexed by rank."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        return [t.tolist() for t in self._all_gather(mine)]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every rank's JSON-serialisable `obj`, indexed by rank (no pickle on the wire).

        One collective when every rank's JSON fits `INLINE_JSON` bytes (an agreement round's verdicts): each
        rank sends its length and its bytes in one fixed-size message; else a second one moves them all,
        padded to the longest."""
        payload = json.dumps(obj).encode()
        head = torch.zeros(8 + INLINE_JSON, dtype=torch.uint8)
        head[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        inline = payload[:INLINE_JSON]
        head[8:8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        heads = [t.cpu() for t in self._all_gather(head.to(self.device))]
        sizes = [int(t[:8].view(torch.int64)[0]) for t in heads]
        if max(sizes) <= INLINE_JSON:
            return [json.loads(t[8:8 + n].numpy().tobytes()) for t, n in zip(heads, sizes)]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = self._all_gather(padded.to(self.device))
        return [json.loads(t.cpu()[:n].numpy().tobytes()) for t, n in zip(out, sizes)]

    def broadcast_json(self, obj: Any, src: int) -> Any:
        """Return `obj` as sent by group rank `src` (JSON-serialisable; ignored on other ranks)."""
        payload = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == src:
            data[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = data.to(self.device)
        self.broadcast(data, src)
        return json.loads(data.cpu().numpy().tobytes())

    def _backend(self) -> Any:
        if self._pg is None:  # raised as a peer failure, like any collective that cannot complete
            raise RuntimeError("the group was shut down: this rank is stopping")
        return self._pg

    def close_backend(self) -> None:
        """Shut the process group down (its peers' pending operations fail within about a second); the
        board stays usable. Safe to call twice."""
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except RuntimeError:
                pass  # a failed group may refuse a clean shutdown; the sockets go with it
            self._pg = None

    def close(self) -> None:
        """Shut the group down; safe to call twice and after a peer failure."""
        self.close_backend()
        if self._store is not None:
            self._store = None
            self.board.close()
            if self._blocking is not None:
                self._blocking.close()
            for shards in self._shards.values():
                shards.close()
        if self._owned_session is not None:
            self._owned_session.close()
            self._owned_session = None


class PendingOp:
    """An in-flight collective; `wait()` turns backend errors into PeerFailureError.

    `done_at` is the `time.perf_counter()` at which the backend finished it
    (from the work's future callback; else when `wait()` returned), for timelines.
    """

    def __init__(self, group: TransportGroup, op: str, work: Any) -> None:
        self._group, self._op, self._work = group, op, work
        self.done_at: Optional[float] = None
        if work is not None:
            try:
                work.get_future().add_done_callback(self._mark_done)
            except (RuntimeError, AttributeError):  # a backend without futures: wait() stamps it
                pass

    def _mark_done(self, _future: Any) -> None:
        if self.done_at is None:
            self.done_at = time.perf_counter()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until done, at most `timeout_s` (None: the group's timeout); PeerFailureError after."""
        if self._work is None:
            return
        try:
            self._work.wait(datetime.timedelta(seconds=self._group.timeout_s if timeout_s is None else timeout_s))
        except RuntimeError as e:
            raise self._group._fail(self._op, e) from e
        finally:
            self._work = None
            self._mark_done(None)

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def init_transport_group(master_address: str, master_port: int, world_size: int, rank: int, *,
                         backend: str = "gloo", timeout: float = 300.0,
                         group_name: str = "megatron_sync") -> TransportGroup:
    """Return a bare transport group of `world_size` ranks after a rendezvous hosted by rank 0.

    For code that forms a group without the drivers (tests, benchmarks): the
    ranks still meet through a sync session (`session.SyncSession`), so a rank
    beyond `world_size`, a second group on the same port, a port in use or a
    port held by something silent are refused or reported by name rather than
    absorbed into the group. The drivers host and join the session themselves,
    with the jobs' full identities, and call `transport_group_over`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    me = Identity(job="", role="member", member=rank, expects={"world_size": world_size})
    if rank == 0:
        session = SyncSession.host(master_address, master_port, me, members={"member": world_size}, timeout_s=timeout)
    else:
        session = SyncSession.join(master_address, master_port, me, timeout_s=timeout)
    try:
        session.wait_ready()
        group = transport_group_over(session, world_size, rank, backend=backend, timeout=timeout,
                                     group_name=group_name)
    except BaseException:
        session.close()
        raise
    group.owns(session)
    return group


def transport_group_over(session: SyncSession, world_size: int, rank: int, *, backend: str = "gloo",
                         timeout: float = 300.0, group_name: str = "megatron_sync") -> TransportGroup:
    """Return the transport group over a ready sync session's store (keys under the session's own prefix).

    Works across separately launched jobs and alongside an existing default
    group: the backend is constructed straight from a PrefixStore, the way
    SGLang's `init_custom_process_group` does, and not registered with
    torch.distributed's world. The prefix carries the session id, so ranks of
    another session can never land in this group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    delta = datetime.timedelta(seconds=timeout)
    name = f"{group_name}/{session.id}"
    prefixed = dist.PrefixStore(name, session.store.raw)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, delta)
    elif backend == "nccl":
        if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
            raise ValueError("backend='nccl' needs CUDA and a torch built with NCCL; use backend='gloo'")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"backend={backend!r} is not valid; use 'gloo' or 'nccl'")
    return TransportGroup(pg, session.store, rank=rank, world_size=world_size, backend=backend,
                          timeout_s=timeout, group_name=name)
