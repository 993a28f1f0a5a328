"""The sync session over the rendezvous store: host it, join it, report a failure into it.

The trainer's first joining rank hosts a TCPStore at master_address:master_port
and answers every join request (`rendezvous.Admission`) from a small thread for
as long as the session lives, so a job that arrives late is refused too. A
joiner connects with a bounded probe (a port held by something that never
answers is reported as such instead of hanging), presents its identity, and
waits for the answer. Once every rank was admitted and the host's own start-up
checks passed, the host marks the session ready and the transport builds its
group over `session.store` under a prefix unique to the session. A rank that
fails while starting posts its error here, and whoever waits on the session
raises it at once.

Keys (under `rdzv/` in the store): `session` (the host's identity, posted
first: it marks the store as a rendezvous), `tickets` (a counter) and
`ticket/<n>` (join requests and failure reports), `answer/<n>`, `ready`,
`failed`, `acks` (answers and failures read: a failed host leaves once all are).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import struct
import threading
import time
import uuid
from typing import Any, Mapping, Optional

import torch.distributed as dist

from megatron_sync.core.wait import Deadline, WaitTimeout, clock, every, poll
from megatron_sync.core.errors import RendezvousError, StoreSilentError
from megatron_sync.session.rendezvous import Admission, Decision, Identity
from megatron_sync.session.store import BoundedStore, bounded

log = logging.getLogger("megatron_sync")

PROBE_S = 10.0  # how long a connected port may stay silent before it counts as "held by something else"
DIAGNOSE_S = 2.0  # how long `host_state` waits for the host to answer (a live store answers in milliseconds)
REPORT_WAIT_S = 30.0  # how long a rank that failed while starting waits for the host to listen, to tell it
ANSWER_EVERY_S = 0.05  # how often the host looks for new join tickets
_STORE_ERRORS = (RuntimeError, dist.DistStoreError, dist.DistNetworkError)


def new_session_id() -> str:
    """Return a fresh session id: sortable by time, unique by a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


class SyncSession:
    """One rank's handle on the session: `store`, `id`, `wait_ready()`, `fail()`, `close()`.

    `store` is a `BoundedStore`: its calls return within `timeout_s` even when the
    host is stopped; `store.raw` is the c10d client (for a process group's rendezvous).
    """

    def __init__(self, store: Any, *, session_id: str, identity: Identity, address: str, port: int,
                 timeout_s: float, admission: Optional[Admission] = None, host: Optional[Identity] = None) -> None:
        self.store: Optional[BoundedStore] = bounded(store, where=f"{address}:{port}", timeout_s=timeout_s)
        self.id, self.identity = session_id, identity
        self.host_identity = host if host is not None else identity  # what the host presented (its settings)
        self.address, self.port, self.timeout_s = address, port, timeout_s
        self._admission = admission  # the host's record (None on joiners)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._answering: Optional[threading.Thread] = None
        self._answered = 0  # tickets answered (host)
        self._ready = False
        self.generation: Optional[int] = None  # fleet: the generation of this engine's job (set on joining)

    @property
    def is_host(self) -> bool:
        return self._admission is not None

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    # ---- hosting ----

    @classmethod
    def host(cls, address: str, port: int, identity: Identity, *, members: Mapping[str, int],
             timeout_s: float, engine_ranks: Optional[int] = None) -> "SyncSession":
        """Host the session (this rank is `identity`, admitted already) and start answering joiners.

        `engine_ranks` (a fleet): inference ranks are not `members`; they join whenever they come, as
        engines of that many ranks (`admitted_engines`)."""
        session_id = identity.session or new_session_id()
        identity = dataclasses.replace(identity, session=session_id)
        try:
            store = dist.TCPStore(address, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except _STORE_ERRORS as e:
            raise RendezvousError(_hosting_problem(address, port, e)) from e
        admission = Admission(session_id, identity, dict(members), engine_ranks=engine_ranks)
        session = cls(store, session_id=session_id, identity=identity, address=address, port=port,
                      timeout_s=timeout_s, admission=admission)
        store.set("rdzv/session", identity.to_json())
        session._answering = threading.Thread(target=session._answer_joiners, name="megatron-sync-rendezvous",
                                              daemon=True)
        session._answering.start()
        return session

    def _answer_joiners(self) -> None:
        """Answer every ticket in order until closed (the thread's own connection to the store)."""
        try:
            store = dist.TCPStore(self.address, self.port, None, False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except _STORE_ERRORS:
            log.exception("the rendezvous at %s cannot answer joiners", self.where)
            return
        for _ in every(ANSWER_EVERY_S, self._stop):
            try:
                count = store.add("rdzv/tickets", 0)
                while self._answered < count:
                    self._answer(store, self._answered + 1)
                    self._answered += 1
            except _STORE_ERRORS:
                if not self._stop.is_set():
                    log.exception("the rendezvous at %s stopped answering joiners", self.where)
                return

    def _answer(self, store: Any, ticket: int) -> None:
        identity = Identity.from_json(store.get(f"rdzv/ticket/{ticket}"))
        with self._lock:
            decision = self._admission.decide(identity)
            failure = self._admission.failure
        store.set(f"rdzv/answer/{ticket}", decision.to_json())
        if decision.fatal and failure == decision.reason:
            store.set("rdzv/failed", failure.encode())
        if decision.accepted:
            log.info("session %s: accepted %s", self.id, identity.describe())
        else:
            log.warning("session %s refused %s: %s", self.id, identity.describe(), decision.reason)

    # ---- joining ----

    @classmethod
    def join(cls, address: str, port: int, identity: Identity, *, timeout_s: float) -> "SyncSession":
        """Join the session hosted at address:port as `identity`; raise RendezvousError if refused."""
        store = connect(address, port, timeout_s=timeout_s)
        decision = _present(store, identity, f"{address}:{port}", timeout_s)
        if not decision.accepted:
            store.close()
            raise RendezvousError(f"the rendezvous at {address}:{port} refused this rank: {decision.reason}")
        host = Identity.from_json(_read(store, "rdzv/session", f"{address}:{port}"))
        log.info("%s joined session %s", identity.describe(), host.session)
        session = cls(store, session_id=host.session, identity=identity, address=address, port=port,
                      timeout_s=timeout_s, host=host)
        session.generation = decision.generation
        return session

    # ---- a fleet's engines ----

    def admitted_engines(self) -> dict[int, tuple[int, str]]:
        """Host of a fleet: engine id -> (generation, job) of every engine whose ranks were all admitted."""
        with self._lock:
            return self._admission.complete_engines()

    def part(self, name: str) -> "SessionPart":
        """Return a part of this session with its own id (`<id>/<name>`) over the same store: what a
        transport connects over for one engine's link, or a relay between two engines."""
        return SessionPart(self, name)

    # ---- both ----

    def wait_ready(self) -> None:
        """Return once every rank was admitted and nobody failed; raise RendezvousError quoting a failure.

        The host marks the session ready here (call it after its own start-up
        checks); joiners wait for that mark, up to `timeout_s`.
        """
        if self._ready:
            return
        deadline = Deadline.after(self.timeout_s)
        if self.is_host:
            self._host_waits(deadline)
        else:
            self._joiner_waits(deadline)
        self._ready = True

    def _host_waits(self, deadline: Deadline) -> None:
        def complete() -> bool:
            with self._lock:
                failure, done = self._admission.failure, self._admission.complete
            if failure is not None:
                raise RendezvousError(f"[session {self.id}] {failure}")
            return done

        poll(complete, within=deadline, what="every rank joining", timeout=lambda _: self._nobody_came())
        self.store.set("rdzv/ready", b"1")

    def _nobody_came(self) -> RendezvousError:
        """Fail the session for the ranks that never joined (the host's wait ran out); return the error."""
        with self._lock:
            missing = {role: sorted(set(range(count)) - set(self._admission.admitted.get(role, {})))
                       for role, count in self._admission.members.items()}
        waiting = "; ".join(f"{role} ranks {m}" for role, m in missing.items() if m)
        problem = (f"not every rank joined the rendezvous at {self.where} within {self.timeout_s:g}s: "
                   f"still missing {waiting}. Start the other job against this address (or check its "
                   "weight_sync.master_address / master_port)")
        self.fail(problem)
        return RendezvousError(f"[session {self.id}] {problem}")

    def _joiner_waits(self, deadline: Deadline) -> None:
        def ready() -> bool:
            failure = _read(self.store, "rdzv/failed", self.where)
            if failure is not None:
                _add(self.store, "rdzv/acks", 1)
                raise RendezvousError(f"[{self.identity.describe()}] session {self.id} failed: {failure.decode()}")
            return _read(self.store, "rdzv/ready", self.where) is not None

        poll(ready, within=deadline, what="the session becoming ready", timeout=lambda _: RendezvousError(
            f"[{self.identity.describe()}] session {self.id} at {self.where} was not ready within "
            f"{self.timeout_s:g}s: the trainer is still starting, or some rank never joined"))

    def fail(self, reason: str) -> None:
        """Tell the session this rank failed (`reason`); whoever waits on it raises, quoting it."""
        try:
            if self.is_host:
                with self._lock:
                    first = self._admission.failure is None
                    if first:
                        self._admission.failure = reason
                if first:
                    self.store.set("rdzv/failed", reason.encode())
            else:
                _present(self.store, _failed(self.identity, reason), self.where, min(self.timeout_s, PROBE_S))
        except (RendezvousError, *_STORE_ERRORS):
            log.warning("could not post this rank's failure to the session at %s", self.where)

    def host_state(self, probe_s: float = DIAGNOSE_S) -> tuple[bool, str]:
        """Return (whether the host answers, a sentence on it) as seen from here now, for an error raised
        after a peer fell silent: the host (the trainer's first stage) is stopped or hung, gone, or alive.
        Takes at most `probe_s`; a host that does not answer counts as silent for this rank's later calls."""
        where = f"its rendezvous at {self.where}"
        if self.store is not None and self.store.silent:
            return False, f"{where} accepts connections but does not answer: the trainer is stopped (e.g. SIGSTOP) or hung"
        probed, probe_s = clock().now(), min(probe_s, self.timeout_s)
        problem = _probe(self.address, self.port, probe_s)
        if problem == "silent" and self.store is not None:
            self.store.found_silent(probed)  # later calls (a rank saying it leaves) fail at once
        return problem is None, {
            None: f"{where} answers: the trainer's first stage is alive, so a rank of the sync is silent or gone",
            "refused": f"{where} refuses connections: the trainer exited or was killed",
            "silent": f"{where} accepts connections but does not answer within {probe_s:g}s: the trainer is "
                      "stopped (e.g. SIGSTOP) or hung",
        }.get(problem, f"{where} cannot be reached ({problem})")

    def close(self, linger_s: float = 5.0) -> None:
        """Stop answering and release the store. A host whose session failed before it was ready stays (up
        to `linger_s`) until every rank of the session has presented itself and read the failure, so ranks
        quote it rather than finding the store gone; it leaves as soon as they have."""
        if self.store is None:
            return
        if self.is_host:
            self._linger_if_failed(linger_s)
            self._stop.set()
            if self._answering is not None:
                self._answering.join(timeout=5.0)
        self.store.close()
        self.store = None

    def _linger_if_failed(self, linger_s: float) -> None:
        # Every answer and every admitted rank's sight of the failure is acknowledged ("acks"): wait for them,
        # and for the ranks that have not presented themselves yet (they are answered with the failure).
        def told_everyone() -> bool:
            with self._lock:
                if self._admission.failure is None or self._ready:
                    return True
                expected = self._answered + sum(len(m) for m in self._admission.admitted.values()) - 1
                everyone = self._admission.all_presented
            return everyone and _add(self.store, "rdzv/acks", 0) >= expected

        try:
            poll(told_everyone, within=linger_s, what="every rank reading the failure")
        except WaitTimeout:
            log.info("the rendezvous at %s leaves after lingering %gs for ranks to read its failure", self.where,
                     linger_s)


class SessionPart:
    """A part of a sync session (`SyncSession.part`): `store`, `id` and `timeout_s`, as a transport uses them.

    Groups built over it live under the part's own prefix, so each link of a fleet, and each relay, is a
    separate process group that can be built, shut down and built again while the session goes on."""

    def __init__(self, session: SyncSession, name: str) -> None:
        self.session, self.name = session, name
        self.id = f"{session.id}/{name}"
        self.timeout_s = session.timeout_s

    @property
    def store(self) -> Optional[BoundedStore]:
        return self.session.store

    def host_state(self, probe_s: float = DIAGNOSE_S) -> tuple[bool, str]:
        return self.session.host_state(probe_s)


def report_failure(address: str, port: int, identity: Identity, reason: str, *, timeout_s: float) -> bool:
    """Post that `identity` failed while starting (before it could join); return True if the host got it.

    Waits at most `REPORT_WAIT_S` (not `timeout_s`) for a host to listen: a trainer launched alongside
    is told, one that died (or starts much later) is not waited for; the failing rank reports its error
    itself either way."""
    store = None
    try:
        store = connect(address, port, timeout_s=timeout_s, wait_s=min(REPORT_WAIT_S, timeout_s))
        _present(store, _failed(identity, reason), f"{address}:{port}", timeout_s)
        return True
    except RendezvousError as e:
        log.warning("could not report this rank's start-up failure to the rendezvous: %s", e)
        return False
    finally:
        if store is not None:
            store.close()


def connect(address: str, port: int, *, timeout_s: float, probe_s: float = PROBE_S,
            wait_s: Optional[float] = None) -> BoundedStore:
    """Return a (bounded) client of the rendezvous store at address:port, waiting up to `wait_s` (default
    `timeout_s`) for its host to listen.

    Raises RendezvousError naming what is wrong: nothing listens there (the
    trainer did not start, or a wrong address), the port is held by a program
    that never answers, or it answers but is not a megatron-sync rendezvous.
    """
    where = f"{address}:{port}"
    wait_s = timeout_s if wait_s is None else wait_s
    def listening() -> bool:
        problem = _probe(address, port, min(probe_s, timeout_s))
        if problem not in (None, "refused"):
            raise _unreachable(where, problem, min(probe_s, timeout_s), wait_s)
        return problem is None

    poll(listening, within=wait_s, what=f"a rendezvous listening at {where}", max_pause_s=0.2,
         timeout=lambda _: _unreachable(where, "refused", min(probe_s, timeout_s), wait_s))
    try:
        store = BoundedStore(dist.TCPStore(address, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                                           wait_for_workers=False), where=where, timeout_s=timeout_s)
    except _STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous at {where}: connecting failed: {e}") from e
    poll(lambda: _read(store, "rdzv/session", where) is not None, within=min(probe_s, timeout_s),
         what="the rendezvous's session marker", timeout=lambda _: RendezvousError(
             f"the store at {where} is not a megatron-sync rendezvous (no session was posted there): is "
             "weight_sync.master_port also some job's MASTER_PORT or another store's port? Choose a free one"))
    return store


def _unreachable(where: str, problem: str, probe_s: float, wait_s: float) -> RendezvousError:
    words = _PROBLEMS.get(problem, "{problem}").format(problem=problem, probe=probe_s, timeout=wait_s)
    return RendezvousError(f"the rendezvous at {where}: {words}")


_PROBLEMS = {
    "refused": "nothing answered for {timeout:g}s (connection refused: nothing listens there). The trainer's "
               "first stage hosts the rendezvous: start the trainer, or check weight_sync.master_address / "
               "master_port",
    "silent": "the port accepted a connection but nothing answered within {probe:g}s: it is held by a program "
              "that is not a megatron-sync rendezvous. Choose another weight_sync.master_port",
}

# What a TCPStore client says first: VALIDATE with torch's magic number, then PING with a nonce the server
# echoes. Only the silence matters here: any reply (even one a future torch words differently) goes on to
# the real client, whose own errors are reported.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


def _probe(address: str, port: int, probe_s: float) -> Optional[str]:
    """Return None if something answers at address:port, "refused", "silent", or the socket error."""
    try:
        sock = socket.create_connection((address, port), timeout=probe_s)
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "silent"
    except OSError as e:
        return f"cannot connect: {e.strerror or e}"
    with sock:
        try:
            sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, os.getpid() & 0xFFFFFFFF))
            sock.settimeout(probe_s)
            sock.recv(4)  # an answer, or b"" when the peer closes: either way it is not silent
        except socket.timeout:
            return "silent"
        except OSError:
            pass
    return None


def _present(store: Any, identity: Identity, where: str, timeout_s: float) -> Decision:
    """Post `identity` as the next ticket and return the host's answer (waiting up to `timeout_s`)."""
    try:
        ticket = store.add("rdzv/tickets", 1)
        store.set(f"rdzv/ticket/{ticket}", identity.to_json())
    except _STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous at {where} went away while {identity.describe()} joined: {e}") from e
    raw = poll(lambda: _read(store, f"rdzv/answer/{ticket}", where), within=timeout_s,
               what=f"the answer to {identity.describe()}", timeout=lambda _: RendezvousError(
                   f"the rendezvous at {where} did not answer {identity.describe()} within {timeout_s:g}s (its "
                   "host is alive but busy or stuck)"))
    _add(store, "rdzv/acks", 1)  # the host may leave once every answer was read
    return Decision.from_json(raw)


def _read(store: Any, key: str, where: str) -> Optional[bytes]:
    """Return the value under `key`, or None if not posted yet; RendezvousError if the host is gone."""
    try:
        return store.get(key) if store.check([key]) else None
    except StoreSilentError as e:
        raise RendezvousError(f"the rendezvous host at {where} stopped answering: {e}") from e
    except _STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous host at {where} went away (the trainer exited or was killed): "
                              f"{e}") from e


def _failed(identity: Identity, reason: str) -> Identity:
    return dataclasses.replace(identity, failure=reason)


def _add(store: Any, key: str, amount: int) -> float:
    """Return the counter under `key` after adding `amount`; infinity once the store is gone (nobody is
    left to wait for)."""
    try:
        return store.add(key, amount)
    except _STORE_ERRORS:
        return float("inf")


def _hosting_problem(address: str, port: int, error: BaseException) -> str:
    text = str(error)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"cannot host the rendezvous at {address}:{port}: the port is already in use (another trainer's "
                "rendezvous, or another program, holds it). Choose a free weight_sync.master_port, or stop the "
                "other job")
    return (f"cannot host the rendezvous at {address}:{port}: {text.splitlines()[0] if text else error!r}. "
            "weight_sync.master_address must be an address of the host of the trainer's first stage")
