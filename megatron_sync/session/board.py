"""The board: small control data (keys and values, never weights) that the two jobs post and fetch.

One class, `Board`, serves every control path: the control channel (`session/control.py`), the transport
group's posts (`group.py`), P2P notices and windows (`transports/p2p`), the ipc data path's keys, a fleet's
links, and disk delta's files. It posts a value under a key, fetches one (waiting up to a bound and naming
the key when nothing came), removes a consumed one, counts the bytes its messages carry when asked, and
words a failure of the medium as the caller's `PeerFailureError`. What differs is where the entries live,
the board's *medium*:

- `PolledStore`: the rendezvous store, polled (a dead host is noticed at once), every call bounded; or, with
  `blocking`, waiting in the store's own get, a slice at a time, on a connection of each waiting thread's
  own (a key is seen the moment it is set; the control channel, where a poll's pauses were latency);
- `WaitingStore`: a store connection of its own, blocking in the store's wait (about 0.1 ms to see a key;
  one per waiting thread), naming a colocated peer that dies while it waits (`watch`);
- `Directory` (`files.py`): files in a shared directory.

`BoardGather` is an all-gather of one JSON object per rank over any board.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from typing import Any, Callable, Iterator, Optional, Protocol

import torch.distributed as dist

from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.core.wait import Deadline, WaitTimeout, poll
from megatron_sync.session.liveness import PeerWatch, death_notice
from megatron_sync.session.store import bounded

Failure = Callable[[str, BaseException], PeerFailureError]


class Medium(Protocol):
    """Where a board's entries live: raw set / wait / delete under full keys."""

    errors: tuple[type[BaseException], ...]  # what its calls raise when the peer or the host failed

    def set(self, key: str, value: bytes) -> None: ...

    def wait(self, key: str, deadline: Deadline, max_pause_s: float) -> Optional[bytes]:
        """Return the value under `key` once posted, None if nothing was by `deadline`."""

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...

    # optional: wait_all(keys, deadline, max_pause_s) -> values once all are set, in one request (`Board.fetch_all`)


class Board:
    """Post small control data under a key, fetch it (waiting up to a timeout), remove it once consumed.

    `prefix` is put before every key; `media`, when given, counts the bytes of keys and values under
    "socket"; `failure` words an error of the medium (default: "[rank r] posting 'k' failed: ...")."""

    def __init__(self, medium: Medium, *, rank: int, timeout_s: float, prefix: str = "",
                 media: Optional[dict[str, int]] = None, failure: Optional[Failure] = None) -> None:
        self.medium, self.rank, self.timeout_s, self._prefix, self._media = medium, rank, timeout_s, prefix, media
        self._failure = failure or (lambda op, e: PeerFailureError(f"[rank {rank}] {op} failed: {e}"))

    def post(self, key: str, value: bytes) -> None:
        """Publish `value` under `key` (small control data, not weights)."""
        self._count(key, value)
        with self._failing(f"posting {key!r}"):
            self.medium.set(self._prefix + key, value)

    def fetch_all(self, keys: list[str], timeout_s: float, *, max_pause_s: float = 0.1) -> Optional[list[bytes]]:
        """Return the values posted under every key of `keys`, in their order, once all are (one request to a
        store that can wait for several keys); None when some are not within `timeout_s`."""
        full = [self._prefix + k for k in keys]
        with self._failing(f"waiting for {keys}"):
            if hasattr(self.medium, "wait_all"):
                values = self.medium.wait_all(full, Deadline.after(timeout_s), max_pause_s)
            else:
                deadline = Deadline.after(timeout_s)
                values = [self.medium.wait(k, deadline, max_pause_s) for k in full]
                values = None if any(v is None for v in values) else values
        for key, value in zip(keys, values or ()):
            self._count(key, value)
        return values

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes:
        """Return the value posted under `key`, waiting up to `timeout_s` (None: the board's timeout) and looking
        at least every `max_pause_s` (a wait inside a sync, where each pause is latency, asks for less)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._failing(f"waiting for {key!r}"):
            value = self.medium.wait(self._prefix + key, Deadline.after(limit), max_pause_s)
        if value is None:
            raise PeerFailureError(f"[rank {self.rank}] nothing was posted under {key!r} within {limit:g}s")
        self._count(key, value)
        return value

    def remove(self, key: str) -> None:
        """Remove `key` (a consumed value), so per-version keys do not pile up."""
        self._count(key, b"")
        with self._failing(f"deleting {key!r}"):
            self.medium.delete(self._prefix + key)

    def close(self) -> None:
        self.medium.close()

    def _count(self, key: str, value: bytes) -> None:
        if self._media is not None:
            self._media["socket"] += len(key) + len(value)

    @contextlib.contextmanager
    def _failing(self, op: str) -> Iterator[None]:
        try:
            yield
        except SyncError:
            raise
        except self.medium.errors as e:
            raise self._failure(op, e) from e


SLICE_S = 1.0
"""The longest blocking wait in the store before a blocking `PolledStore` looks at its deadline again."""


class PolledStore:
    """A board's medium over the rendezvous store, polled rather than blocking in the store, so a store whose
    host died (the trainer) is noticed at once, and bounded (`store.BoundedStore`), so a host that is stopped
    or hung is noticed within `timeout_s` as a `StoreSilentError`.

    With `blocking`, a wait blocks in the store's own get instead (which waits for the key and reads it in one
    request), in slices of at most `SLICE_S`, each a bounded call on a clone of the store (one per waiting
    thread: a blocking get holds its connection and sets its timeout), so
    a key is taken the moment it is set, while a dead host still raises at once and a stopped one
    (whose client never returns from a timed-out wait) within `timeout_s`."""

    errors = (RuntimeError, dist.DistStoreError)

    def __init__(self, store: Any, *, timeout_s: float, blocking: bool = False) -> None:
        self._store = bounded(store, where="the rendezvous store", timeout_s=timeout_s)
        self._slice_s = min(SLICE_S, timeout_s / 4)  # a slice never looks like a silent host
        self._waiters = threading.local() if blocking else None
        self._clones: list[Any] = []  # the waiting threads' connections, closed with this medium

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def wait(self, key: str, deadline: Deadline, max_pause_s: float) -> Optional[bytes]:
        values = self.wait_all([key], deadline, max_pause_s)
        return None if values is None else values[0]

    def wait_all(self, keys: list[str], deadline: Deadline, max_pause_s: float) -> Optional[list[bytes]]:
        """`wait` for every key at once: the values in order once all are set, None if not by `deadline`."""
        if self._waiters is not None:
            return self._wait_blocking(keys, deadline)
        try:
            poll(lambda: self._store.check(keys, bound=deadline.remaining()), within=deadline,
                 what=f"values under {keys!r}", max_pause_s=max_pause_s)
        except WaitTimeout:
            return None
        return [self._store.get(key, bound=deadline.remaining()) for key in keys]

    def _wait_blocking(self, keys: list[str], deadline: Deadline) -> Optional[list[bytes]]:
        waiter = getattr(self._waiters, "store", None)
        if waiter is None:
            waiter = self._waiters.store = self._store.clone()
            self._clones.append(waiter)
        while True:
            # bounded by timeout_s, as every call: a stopped host is named after that long, not after one slow
            # answer (a slice takes at most a quarter of it). One request, not a wait and a get per key: at full
            # scale a store serves tens of thousands of P2P reports a version (bench/bench_store.py)
            within = max(min(self._slice_s, deadline.remaining()), 0.001)
            try:
                return waiter.get_within(keys, within)
            except dist.DistStoreError as e:
                if "timeout" not in str(e):
                    raise
            if deadline.expired():
                return None

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def close(self) -> None:
        for clone in self._clones:
            clone.close()
        self._store, self._clones = None, []


class WaitingStore:
    """A board's medium on a store connection of its own, blocking in the store's own wait, which the store
    answers the moment the key is set (about 0.1 ms here, where polling adds 5-100 ms to every message), and
    which fails at once when the store's host is gone. A blocking wait holds its connection, so every thread
    that waits has its own board, on its own clone of the session's store."""

    errors = (RuntimeError, dist.DistError)

    def __init__(self, store: Any) -> None:
        self._store = store
        self.watch: Optional[PeerWatch] = None  # once set, a peer that dies while we wait is named at once

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def wait(self, key: str, deadline: Deadline, max_pause_s: float) -> Optional[bytes]:
        """`max_pause_s` is moot: the store's own wait answers at once."""
        try:
            with self.watch.waiting(key) if self.watch is not None else contextlib.nullcontext():
                self._store.wait([key], datetime.timedelta(seconds=deadline.remaining()))
        except dist.DistStoreError as e:
            if "timeout" not in str(e):
                raise
            return None
        value = self._store.get(key)
        died = death_notice(value)
        if died is not None:
            raise PeerFailureError(f"{died} died while this rank waited for {key!r}")
        return value

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def close(self) -> None:
        self._store = None


def store_board(store: Any, *, prefix: str, rank: int, timeout_s: float, failure: Optional[Failure] = None,
                media: Optional[dict[str, int]] = None, blocking: bool = False) -> Board:
    """Return a board over the rendezvous store, polled (or `blocking` in slices) and bounded (`PolledStore`)."""
    return Board(PolledStore(store, timeout_s=timeout_s, blocking=blocking), rank=rank, timeout_s=timeout_s,
                 prefix=prefix, media=media, failure=failure)


def waiting_board(store: Any, *, prefix: str, rank: int, timeout_s: float, media: dict[str, int],
                  failure: Failure) -> Board:
    """Return a board blocking in the store's wait on `store`, a connection this thread alone uses
    (`WaitingStore`); its bytes are counted in `media`."""
    return Board(WaitingStore(store), rank=rank, timeout_s=timeout_s, prefix=prefix, media=media, failure=failure)


class BoardGather:
    """All-gather of one JSON object per rank among `size` ranks, through a board (rounds numbered in order).

    Each rank posts its object for round r and reads everybody's. Once a rank finished round r,
    every rank has posted r, hence finished reading r - 1: the rank then removes its post of r - 1.
    """

    def __init__(self, board: Board, *, name: str, index: int, size: int) -> None:
        self.board, self.name, self.index, self.size = board, name, index, size
        self._round = 0

    def __call__(self, obj: Any) -> list[Any]:
        self._round += 1
        self.board.post(f"gather/{self.name}/{self._round}/{self.index}", json.dumps(obj).encode())
        values = [json.loads(self.board.fetch(f"gather/{self.name}/{self._round}/{r}")) for r in range(self.size)]
        if self._round > 1:
            try:
                self.board.remove(f"gather/{self.name}/{self._round - 1}/{self.index}")
            except PeerFailureError:
                pass  # the gather is whole; after the last one the store's host may have left (nothing to clean)
        return values
