"""Liveness of colocated peers: a dead process on this host is noticed within a second, not after timeout_s.

The `ipc` transport's ranks share one host, so while a rank waits for a peer's
control message it can look at the peers' processes themselves. Each rank
posts its `ProcessId` (host, pid namespace, pid, start time); a `PeerWatch`
thread checks, every `CHECK_EVERY_S` while this process waits for a key, that every
peer it can see (same host, same pid namespace) still runs, and when one does
not, it posts a death notice under the awaited key itself (`compare_set`: only
if nothing was posted there), which wakes the waiter with the peer's name.
Peers it cannot see (another pid namespace) are left to `timeout_s`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping, Optional

from megatron_sync.core.wait import every

DEATH_NOTICE = b"megatron-sync: peer died: "
CHECK_EVERY_S = 0.5


def _start_time(pid: int) -> Optional[int]:
    """Return the process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


@dataclass(frozen=True)
class ProcessId:
    """One process, as its host and pid namespace see it (the start time tells a reused pid apart)."""

    host: str
    pidns: int
    pid: int
    start: int

    @classmethod
    def mine(cls) -> "ProcessId":
        return cls(socket.gethostname(), _pid_namespace(), os.getpid(), _start_time(os.getpid()) or 0)

    def visible_here(self) -> bool:
        """True when this process can look at that one (same host, same pid namespace)."""
        return self.host == socket.gethostname() and self.pidns == _pid_namespace()

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ProcessId":
        return cls(**json.loads(raw.decode()))


class PeerWatch:
    """Watches `peers` (transport rank -> ProcessId) while this process waits; see the module doc.

    `store` is a connection of the watch's own; `prefix` the waiting boards' key prefix.
    """

    def __init__(self, store: Any, prefix: str, peers: Mapping[int, ProcessId]) -> None:
        self._store, self._prefix = store, prefix
        self._peers = {rank: p for rank, p in peers.items() if p.visible_here() and p.pid != os.getpid()}
        self._waiting: dict[int, str] = {}  # thread ident -> the key it waits for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-sync-peer-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, key: str) -> Iterator[None]:
        """Mark that this thread waits for `key` while the block runs."""
        me = threading.get_ident()
        with self._lock:
            self._waiting[me] = key
        try:
            yield
        finally:
            with self._lock:
                self._waiting.pop(me, None)

    def _run(self) -> None:
        for _ in every(CHECK_EVERY_S, self._stop):
            with self._lock:
                keys = list(self._waiting.values())
            if not keys:
                continue
            dead = next(((rank, p) for rank, p in self._peers.items() if not p.alive()), None)
            if dead is None:
                continue
            notice = DEATH_NOTICE + f"transport rank {dead[0]} (pid {dead[1].pid})".encode()
            try:
                for key in keys:
                    self._store.compare_set(self._prefix + key, "", notice)
            except RuntimeError:
                return  # the store is gone too: the waiter learns it from its own connection

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * CHECK_EVERY_S)
        self._store = None


def death_notice(value: bytes) -> Optional[str]:
    """Return who died when `value` is a death notice, else None."""
    return value[len(DEATH_NOTICE):].decode() if value.startswith(DEATH_NOTICE) else None
