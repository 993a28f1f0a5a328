"""The transport group, the errors every rank agrees on, and the small Transport interface.

The transport group is a dedicated process group joining the P stage source
ranks (group ranks 0..P-1, stage s = rank s) and the N inference ranks (group
ranks P..P+N-1). It is built from a TCPStore rendezvous under a PrefixStore, so
separately launched jobs can join it, and it never touches (or is registered
as) the training job's default group: collectives are called on the backend
object itself, and each is bounded by `timeout_s`.
"""

from __future__ import annotations

import abc
import datetime
import json
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sync.meta import TensorMeta
from megatron_sync.plan import BucketPlan, SyncPlan, build_plan


class SyncError(RuntimeError):
    """Base of the errors a sync raises."""


class PeerFailureError(SyncError):
    """A collective of the transport group failed or timed out: a peer died or hangs."""


class PlanMismatchError(SyncError):
    """Ranks computed different sync plans (or the plan does not cover the engine)."""


class CorruptBucketError(SyncError):
    """A received bucket's checksum or header did not match; nothing of it is applied."""


class SyncAbortedError(SyncError):
    """Some rank failed this sync; every rank raises this and engines keep the previous version."""

    def __init__(self, version: int, failures: Sequence[tuple[int, str]]) -> None:
        self.version = version
        self.failures = list(failures)
        lines = "\n".join(f"  transport rank {r}: {msg}" for r, msg in self.failures)
        super().__init__(
            f"sync of version {version} aborted on every rank; failing ranks "
            f"{[r for r, _ in self.failures]}:\n{lines}"
        )


class TransportGroup:
    """A process group over a rendezvous store, with timeout-bounded collectives."""

    def __init__(self, backend_pg: Any, store: Any, *, rank: int, world_size: int,
                 backend: str, timeout_s: float, group_name: str) -> None:
        self._pg, self._store = backend_pg, store
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_s, self.group_name = backend, timeout_s, group_name
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _fail(self, op: str, error: BaseException) -> PeerFailureError:
        return PeerFailureError(
            f"[transport rank {self.rank}] {op} on group {self.group_name!r} failed or timed out "
            f"(timeout {self.timeout_s:g}s); expected transport ranks 0..{self.world_size - 1} "
            f"to take part: {error}"
        )

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> "Pending":
        """Broadcast `tensor` in place from group rank `src`; return a handle (already waited unless async)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        try:
            pending = Pending(self, "broadcast", self._pg.broadcast([tensor], opts))
        except RuntimeError as e:
            raise self._fail("broadcast", e) from e
        if not async_op:
            pending.wait()
        return pending

    def _all_gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Return every rank's `mine` (same shape on every rank), indexed by rank."""
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = self._pg.allgather([out], [mine])
        except RuntimeError as e:
            raise self._fail("all_gather", e) from e
        Pending(self, "all_gather", work).wait()
        return out

    def all_gather_int64(self, values: Sequence[int]) -> list[list[int]]:
        """Return every rank's `values` (same length on every rank), indexed by rank."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        return [t.tolist() for t in self._all_gather(mine)]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every rank's JSON-serialisable `obj`, indexed by rank (no pickle on the wire)."""
        payload = json.dumps(obj).encode()
        sizes = [s[0] for s in self.all_gather_int64([len(payload)])]
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

    def post(self, key: str, value: bytes) -> None:
        """Publish `value` under `key` in the rendezvous store (small control data, not weights)."""
        try:
            self._store.set(f"{self.group_name}/post/{key}", value)
        except (RuntimeError, dist.DistStoreError) as e:
            raise self._fail(f"posting {key!r}", e) from e

    def fetch(self, key: str, timeout_s: Optional[float] = None) -> bytes:
        """Return the value posted under `key`, waiting up to `timeout_s` (None: the group timeout).

        Polls rather than blocking in the store, so a store whose host died
        (the trainer) is noticed at once as a PeerFailureError.
        """
        full_key = f"{self.group_name}/post/{key}"
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pause = 0.005
        try:
            while not self._store.check([full_key]):
                if time.monotonic() > deadline:
                    raise PeerFailureError(
                        f"[transport rank {self.rank}] nothing was posted under {key!r} within {limit:g}s"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
            return self._store.get(full_key)
        except SyncError:
            raise
        except (RuntimeError, dist.DistStoreError) as e:
            raise self._fail(f"waiting for {key!r}", e) from e

    def close(self) -> None:
        """Shut the group down; safe to call twice and after a peer failure."""
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except RuntimeError:
                pass  # a failed group may refuse a clean shutdown; the sockets go with it
            self._pg = None
            self._store = None


class Pending:
    """An in-flight collective; `wait()` turns backend errors into PeerFailureError."""

    def __init__(self, group: TransportGroup, op: str, work: Any) -> None:
        self._group, self._op, self._work = group, op, work

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(datetime.timedelta(seconds=self._group.timeout_s))
        except RuntimeError as e:
            raise self._group._fail(self._op, e) from e
        finally:
            self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def init_transport_group(master_address: str, master_port: int, world_size: int, rank: int, *,
                         backend: str = "gloo", timeout: float = 300.0,
                         group_name: str = "megatron_sync") -> TransportGroup:
    """Return the transport group after a TCP rendezvous (rank 0 hosts the store).

    Works across separately launched jobs and alongside an existing default
    group: the backend is constructed straight from a PrefixStore(group_name),
    the way SGLang's `init_custom_process_group` does, and not registered with
    torch.distributed's world.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    delta = datetime.timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=delta)
    except (RuntimeError, dist.DistStoreError) as e:
        raise PeerFailureError(
            f"[transport rank {rank}] rendezvous at {master_address}:{master_port} for "
            f"{world_size} ranks did not complete within {timeout:g}s: {e}"
        ) from e
    prefixed = dist.PrefixStore(group_name, store)
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
    return TransportGroup(pg, store, rank=rank, world_size=world_size, backend=backend,
                          timeout_s=timeout, group_name=group_name)


@dataclass(frozen=True)
class BucketHeader:
    """What precedes each bucket's payload: version, bucket index, nbytes, checksum.

    nbytes == ABORTED_NBYTES marks a bucket whose sender failed before filling
    it; the payload still travels (so every rank stays in lockstep) and is dropped.
    """

    version: int
    index: int
    nbytes: int
    checksum: int

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.version, self.index, self.nbytes, self.checksum],
                            dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "BucketHeader":
        return cls(*(int(x) for x in t.tolist()))


ABORTED_NBYTES = -1


class Transport(abc.ABC):
    """Moves plan buckets from stage sources to inference ranks; other transports fit here."""

    rank: int
    world_size: int
    num_stages: int

    @abc.abstractmethod
    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return every stage's tensor metadata; sources pass their own stage's list, others None."""

    @abc.abstractmethod
    def send_bucket(self, header: BucketHeader, bucket: BucketPlan, data: torch.Tensor) -> Pending:
        """Start sending one bucket of this rank's stage; return the in-flight handle."""

    @abc.abstractmethod
    def recv_bucket(self, bucket: BucketPlan, out: torch.Tensor) -> "PendingBucket":
        """Start receiving `bucket` into `out`; `.wait()` returns (header, bytes)."""

    @abc.abstractmethod
    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every transport rank's JSON-serialisable `obj`, indexed by rank."""

    def agree(self, status: Optional[str]) -> list[tuple[int, str]]:
        """Return the failures [(rank, message)] of all ranks, given this rank's (None = ok)."""
        return [(r, msg) for r, msg in self.all_gather_json([self.rank, status]) if msg is not None]

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group and buffers."""


class PendingBucket:
    """An in-flight bucket receive; `wait()` returns (header, payload bytes)."""

    def __init__(self, header_pending: Pending, header: torch.Tensor,
                 payload_pending: Pending, payload: torch.Tensor) -> None:
        self._parts = (header_pending, header, payload_pending, payload)

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        header_pending, header, payload_pending, payload = self._parts
        header_pending.wait()
        payload_pending.wait()
        return BucketHeader.from_tensor(header), payload


def handshake_plan(transport: Transport, stage_metas: Optional[list[TensorMeta]],
                   bucket_size_bytes: int, keep_together: Any,
                   expected: Optional[list[TensorMeta]] = None) -> SyncPlan:
    """Return the SyncPlan every rank agrees on, or raise PlanMismatchError on every rank.

    Stage sources pass their stage's metadata, other ranks None. Each rank builds
    the plan with its *own* bucket size and keep-together groups, then all ranks
    all-gather (digest, coverage problem); a differing digest, or an engine whose
    expected tensors the plan does not cover exactly, fails every rank alike.
    """

    plan = build_plan(transport.exchange_metadata(stage_metas), bucket_size_bytes, keep_together)
    problem = coverage_problem(plan.tensors(), expected) if expected is not None else None
    reports = transport.all_gather_json([transport.rank, plan.digest(), problem])
    by_digest: dict[str, list[int]] = {}
    for rank, digest, _ in reports:
        by_digest.setdefault(digest, []).append(rank)
    if len(by_digest) > 1:
        groups = "; ".join(f"ranks {ranks} -> {d[:12]}" for d, ranks in sorted(by_digest.items(), key=lambda kv: kv[1]))
        raise PlanMismatchError(
            f"[transport rank {transport.rank}] ranks computed different sync plans ({groups}); "
            "check that every rank uses the same bucket_size_mb, keep-together groups and code version"
        )
    problems = [(rank, p) for rank, _, p in reports if p]
    if problems:
        raise PlanMismatchError(
            f"[transport rank {transport.rank}] the plan does not match the engines' expected tensors:\n"
            + "\n".join(f"  transport rank {r}: {p}" for r, p in problems)
        )
    return plan


def coverage_problem(planned: list[TensorMeta], expected: list[TensorMeta]) -> Optional[str]:
    """Return a message naming missing/unexpected/mismatched tensors, or None if they agree exactly."""
    have = {m.name: m for m in planned}
    want = {m.name: m for m in expected}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    mismatched = sorted(
        f"{n}: sent {tuple(have[n].shape)} {have[n].dtype}, engine expects {tuple(want[n].shape)} {want[n].dtype}"
        for n in set(have) & set(want)
        if (tuple(have[n].shape), have[n].dtype) != (tuple(want[n].shape), want[n].dtype)
    )
    parts = []
    if missing:
        parts.append(f"missing (engine expects, trainer does not send): {missing[:20]}")
    if unexpected:
        parts.append(f"unexpected (trainer sends, engine does not expect): {unexpected[:20]}")
    if mismatched:
        parts.append(f"mismatched: {mismatched[:20]}")
    return "; ".join(parts) or None
