"""Boards: small control data (keys and values, never weights) that the two jobs post and fetch.

One protocol, `Board`, serves every control path: the control channel (`session/control.py`), P2P
notices and windows (`transports/p2p`), the ipc data path's keys, and disk delta's files. The boards:

- `StoreBoard`: over the rendezvous store, polled (a dead host is noticed at once), every call bounded;
- `WaitingBoard`: over a store connection of its own, blocking in the store's wait (about 0.1 ms to see a
  key; one per waiting thread), naming a colocated peer that dies while it waits;
- `CountingBoard`: a `StoreBoard` that counts the bytes its messages carry;
- `DirectoryBoard` (`files.py`): files in a shared directory (a directory session's board).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, Optional, Protocol

import torch.distributed as dist

from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.core.wait import Deadline, poll
from megatron_sync.session.liveness import PeerWatch, death_notice
from megatron_sync.session.store import bounded


class Board(Protocol):
    """Post small control data under a key, fetch it (waiting up to a timeout), remove it once consumed."""

    timeout_s: float

    def post(self, key: str, value: bytes) -> None: ...

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes: ...

    def remove(self, key: str) -> None: ...


class StoreBoard:
    """Small control data over a rendezvous store: `post` a value under a key, `fetch` it (bounded).

    `fetch` polls rather than blocking in the store, so a store whose host died
    (the trainer) is noticed at once as a PeerFailureError, and every call is
    bounded (`store.BoundedStore`), so a host that is stopped or hung is noticed
    within `timeout_s` as a `StoreSilentError`.
    """

    def __init__(self, store: Any, *, prefix: str, rank: int, timeout_s: float,
                 failure: Optional[Callable[[str, BaseException], PeerFailureError]] = None) -> None:
        self._store = bounded(store, where="the rendezvous store", timeout_s=timeout_s)
        self._prefix, self.rank, self.timeout_s = prefix, rank, timeout_s
        self._failure = failure or (lambda op, e: PeerFailureError(f"[rank {rank}] {op} failed: {e}"))

    def post(self, key: str, value: bytes) -> None:
        """Publish `value` under `key` (small control data, not weights)."""
        try:
            self._store.set(self._prefix + key, value)
        except SyncError:
            raise
        except (RuntimeError, dist.DistStoreError) as e:
            raise self._failure(f"posting {key!r}", e) from e

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes:
        """Return the value posted under `key`, waiting up to `timeout_s` (None: the board's timeout) and looking
        at least every `max_pause_s` (a wait inside a sync, where each pause is latency, asks for less)."""
        full_key = self._prefix + key
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = Deadline.after(limit)
        try:
            poll(lambda: self._store.check([full_key], bound=deadline.remaining()), within=deadline,
                 what=f"a value under {key!r}", max_pause_s=max_pause_s, timeout=lambda _: PeerFailureError(
                     f"[rank {self.rank}] nothing was posted under {key!r} within {limit:g}s"))
            return self._store.get(full_key, bound=deadline.remaining())
        except SyncError:
            raise
        except (RuntimeError, dist.DistStoreError) as e:
            raise self._failure(f"waiting for {key!r}", e) from e

    def remove(self, key: str) -> None:
        """Remove `key` (a consumed value), so per-version keys do not pile up in the store."""
        try:
            self._store.delete_key(self._prefix + key)
        except SyncError:
            raise
        except (RuntimeError, dist.DistStoreError) as e:
            raise self._failure(f"deleting {key!r}", e) from e

    def close(self) -> None:
        self._store = None


class CountingBoard:
    """A `StoreBoard` (the control channel's) that counts the bytes its messages carry over the socket."""

    def __init__(self, board: StoreBoard, media: dict[str, int]) -> None:
        self._board, self._media = board, media
        self.timeout_s = board.timeout_s

    def post(self, key: str, value: bytes) -> None:
        self._media["socket"] += len(key) + len(value)
        self._board.post(key, value)

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes:
        value = self._board.fetch(key, timeout_s, max_pause_s=max_pause_s)
        self._media["socket"] += len(key) + len(value)
        return value

    def remove(self, key: str) -> None:
        self._media["socket"] += len(key)
        self._board.remove(key)

    def close(self) -> None:
        self._board.close()


class WaitingBoard:
    """Post / fetch / remove control keys of the data path on a store connection of its own.

    `fetch` blocks in the store's own wait, which the store answers the moment the key is set
    (about 0.1 ms here, where `StoreBoard`'s polling adds 5-100 ms to every message), and fails at once
    when the store's host is gone. A blocking wait holds its connection, so every thread that waits
    has its own board, on its own clone of the session's store. Bytes (keys and values) are counted.
    """

    def __init__(self, store: Any, *, prefix: str, timeout_s: float, media: dict[str, int],
                 failure: Callable[[str, BaseException], PeerFailureError]) -> None:
        self._store, self._prefix, self.timeout_s = store, prefix, timeout_s
        self._media, self._failure = media, failure
        self.watch: Optional[PeerWatch] = None  # once set, a peer that dies while we wait is named at once

    def post(self, key: str, value: bytes) -> None:
        self._media["socket"] += len(key) + len(value)
        try:
            self._store.set(self._prefix + key, value)
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(f"posting {key!r}", e) from e

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes:
        """Return the value posted under `key` (`max_pause_s` is moot: the store's own wait answers at once)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            with self.watch.waiting(key) if self.watch is not None else contextlib.nullcontext():
                self._store.wait([self._prefix + key], datetime.timedelta(seconds=limit))
            value = self._store.get(self._prefix + key)
        except dist.DistStoreError as e:
            if "timeout" not in str(e):
                raise self._failure(f"waiting for {key!r}", e) from e
            raise PeerFailureError(f"nothing was posted under {key!r} within {limit:g}s") from e
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(f"waiting for {key!r}", e) from e
        self._media["socket"] += len(key) + len(value)
        died = death_notice(value)
        if died is not None:
            raise PeerFailureError(f"{died} died while this rank waited for {key!r}")
        return value

    def remove(self, key: str) -> None:
        """Delete a consumed key (`FileGather` calls it once every rank read it)."""
        self._media["socket"] += len(key)
        try:
            self._store.delete_key(self._prefix + key)
        except (RuntimeError, dist.DistError) as e:
            raise self._failure(f"deleting {key!r}", e) from e

    def close(self) -> None:
        self._store = None
