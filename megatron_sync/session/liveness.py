"""Liveness: colocated peers (a dead process on this host noticed within a second), and a fleet's engine ranks.

Colocated peers. The `ipc` transport's ranks share one host, so while a rank waits for a peer's
control message it can look at the peers' processes themselves. Each rank
posts its `ProcessId` (host, pid namespace, pid, start time); a `PeerWatch`
thread checks, every `CHECK_EVERY_S` while this process waits for a key, that every
peer it can see (same host, same pid namespace) still runs, and when one does
not, it posts a death notice under the awaited key itself (`compare_set`: only
if nothing was posted there), which wakes the waiter with the peer's name.
Peers it cannot see (another pid namespace) are left to `timeout_s`.

A fleet's engine ranks. Every admitted engine rank answers the rendezvous
host's "are you there" (`EngineAnswers`: a thread blocked on its own store
connection, so nothing moves while nobody asks). The host asks (`AliveQuery`)
when a new job presents the engine id of a job it has admitted (a duplicate is
refused while that job answers), and the fleet's leader asks every linked
engine at each sync boundary (one that does not answer within `LIVE_WITHIN_S`
left the fleet before the sync starts). A live rank answers in milliseconds; a
rank that closed its session said so (`gone`) and counts as gone at once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch.distributed as dist

from megatron_sync.core.wait import Deadline, every, poll

log = logging.getLogger("megatron_sync")

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

    `store` is a connection of the watch's own; the keys waited for are full store keys (a board's prefix
    included: `board.WaitingStore` passes them so).
    """

    def __init__(self, store: Any, peers: Mapping[int, ProcessId]) -> None:
        self._store = store
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
                    self._store.compare_set(key, "", notice)
            except RuntimeError:
                return  # the store is gone too: the waiter learns it from its own connection

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * CHECK_EVERY_S)
        self._store = None


def death_notice(value: bytes) -> Optional[str]:
    """Return who died when `value` is a death notice, else None."""
    return value[len(DEATH_NOTICE):].decode() if value.startswith(DEATH_NOTICE) else None


# ---- a fleet's engine ranks ----

LIVE_WITHIN_S = 5.0
"""How long an engine rank may take to answer the host's "are you there" before it counts as gone (a live one
answers in milliseconds; generous for a loaded machine)."""
_WAIT_DAY = datetime.timedelta(days=1)  # an answering thread's wait: no timeout, so no log line, while idle
_STORE_ERRORS = (RuntimeError, dist.DistStoreError, dist.DistNetworkError)


def live_prefix(engine: int, generation: int, rank: int) -> str:
    """Return the store prefix of one engine rank's answers: `ask/<n>` (asked), `answer` (n), `gone`."""
    return f"rdzv/live/{engine}/{generation}/{rank}"


class EngineAnswers:
    """Answers the host's "are you there" for one admitted engine rank (see the module doc), from a thread on
    a store connection of its own; `close(store)` says the rank is gone."""

    def __init__(self, address: str, port: int, *, engine: int, generation: int, rank: int, timeout_s: float):
        self.prefix = live_prefix(engine, generation, rank)
        self._raw = dist.TCPStore(address, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        self._asked = 1  # the next question this rank waits for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-sync-engine-answers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            key = f"{self.prefix}/ask/{self._asked}"
            try:
                self._raw.wait([key], _WAIT_DAY)
                if self._stop.is_set():
                    return
                self._raw.set(f"{self.prefix}/answer", str(self._asked).encode())
                self._raw.delete_key(key)
            except _STORE_ERRORS:
                return  # the host went away: this rank's own waits say so
            self._asked += 1

    def close(self, store: Any) -> None:
        """Say this rank is gone and end the thread, through `store` (a bounded client: a silent host is not
        waited for beyond its bound)."""
        self._stop.set()
        try:
            store.set(f"{self.prefix}/gone", b"1")
            store.set(f"{self.prefix}/ask/{self._asked}", b"1")  # wakes the thread, which then ends
        except Exception as e:  # noqa: BLE001 — the host is gone or silent: nobody asks any more
            log.info("%s: could not say this rank is gone: %s", self.prefix, e)
        self._thread.join(timeout=CHECK_EVERY_S)


class AliveQuery:
    """Asks engine ranks (engine, generation, each of `ranks`) whether they are there; `answer()` says once known.

    `every`: all of them must answer (an engine that can take a version); else one is enough (a job that
    still holds its engine id)."""

    def __init__(self, store: Any, engine: int, generation: int, ranks: Iterable[int], *, every: bool,
                 within_s: float = LIVE_WITHIN_S) -> None:
        self.store, self.every, self.deadline = store, every, Deadline.after(within_s)
        self.asked: dict[int, int] = {}  # rank -> the question it must answer
        self.gone: list[int] = []
        for rank in ranks:
            prefix = live_prefix(engine, generation, rank)
            if store.check([f"{prefix}/gone"]):
                self.gone.append(rank)
                continue
            self.asked[rank] = _counter(store, f"{prefix}/answer") + 1
            store.set(f"{prefix}/ask/{self.asked[rank]}", b"1")
        self._prefix = {rank: live_prefix(engine, generation, rank) for rank in self.asked}

    def silent(self) -> list[int]:
        """Return the ranks that have not answered (or said they are gone)."""
        return sorted(self.gone + [r for r, n in self.asked.items()
                                   if _counter(self.store, f"{self._prefix[r]}/answer") < n])

    def answer(self) -> Optional[bool]:
        """True once the ranks answered (all, or one), False once they cannot any more, None while unknown."""
        silent = self.silent()
        answered = len(self.asked) + len(self.gone) - len(silent)
        if answered == len(self.asked) + len(self.gone) or (answered > 0 and not self.every):
            return True
        if self.deadline.expired() or (self.every and self.gone) or not self.asked:
            return False
        return None


def unanswered(store: Any, engines: Mapping[int, int], ranks: int, *, within_s: float = LIVE_WITHIN_S
               ) -> dict[int, str]:
    """Ask every rank of each engine (engine id -> generation; `ranks` ranks each) whether it is there; return
    engine -> why it counts as gone, for those with a rank that did not answer within `within_s`."""
    queries = {engine: AliveQuery(store, engine, generation, range(ranks), every=True, within_s=within_s)
               for engine, generation in engines.items()}
    poll(lambda: all(q.answer() is not None for q in queries.values()), within=within_s + 1.0,
         what="the fleet's engines answering")
    return {engine: (f"its rank(s) {q.silent()} did not answer at the sync boundary within {within_s:g}s "
                     "(the engine died, was stopped, or left)") for engine, q in queries.items() if not q.answer()}


def _counter(store: Any, key: str) -> int:
    return int(store.get(key)) if store.check([key]) else 0

