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
`failed`, `acks` (answers and failures read: a failed host leaves once all are),
`live/...` (a fleet's engine ranks answering "are you there", `liveness.py`).

With a session secret (`secret.py`, read by the drivers) the host's identity
and every ticket carry a keyed digest instead of it; probing, connecting and
presenting a ticket live in `reach.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
import uuid
from typing import Any, Mapping, Optional

import torch.distributed as dist

from megatron_sync.core.wait import Deadline, WaitTimeout, clock, every, poll
from megatron_sync.core.errors import RendezvousError
from megatron_sync.session.liveness import AliveQuery, EngineAnswers
from megatron_sync.session.reach import (  # noqa: F401 — connect and report_failure are this module's API too
    PROBE_S, REPORT_WAIT_S, STORE_ERRORS, _probe, add, connect, hosting_problem, present, read, report_failure,
)
from megatron_sync.session.rendezvous import Admission, Decision, Identity, signed
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.store import BoundedStore, bounded

log = logging.getLogger("megatron_sync")

DIAGNOSE_S = 2.0  # how long `host_state` waits for the host to answer (a live store answers in milliseconds)
ANSWER_EVERY_S = 0.05  # how often the host looks for new join tickets


def log_decision(session_id: str, identity: Identity, decision: Decision) -> None:
    """Log a host's answer to a joining rank (either medium's host: the store's, the directory's)."""
    if decision.accepted:
        log.info("session %s: accepted %s", session_id, identity.describe())
    else:
        log.warning("session %s refused %s: %s", session_id, identity.describe(), decision.reason)


def new_session_id() -> str:
    """Return a fresh session id: sortable by time, unique by a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


class SyncSession:
    """One rank's handle on the session: `store`, `id`, `wait_ready()`, `fail()`, `close()`.

    `store` is a `BoundedStore`: its calls return within `timeout_s` even when the
    host is stopped; `store.raw` is the c10d client (for a process group's rendezvous).
    """

    def __init__(self, store: Any, *, session_id: str, identity: Identity, address: str, port: int,
                 timeout_s: float, admission: Optional[Admission] = None, host: Optional[Identity] = None,
                 secret: Optional[SessionSecret] = None) -> None:
        self.store: Optional[BoundedStore] = bounded(store, where=f"{address}:{port}", timeout_s=timeout_s)
        self.id, self.identity = session_id, identity
        self.host_identity = host if host is not None else identity  # what the host presented (its settings)
        self.address, self.port, self.timeout_s = address, port, timeout_s
        self._admission = admission  # the host's record (None on joiners)
        self._secret = secret  # what this rank proves (never sent: see secret.py)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._answering: Optional[threading.Thread] = None
        self._answered = 0  # tickets taken up (host)
        self._replied = 0  # answers posted (host)
        self._pending: list[tuple[int, Identity, AliveQuery]] = []  # tickets waiting on an engine's answer
        self._ready = False
        self.generation: Optional[int] = None  # fleet: the generation of this engine's job (set on joining)
        self._answers: Optional[EngineAnswers] = None  # fleet engine rank: answers the host's "are you there"

    @property
    def is_host(self) -> bool:
        return self._admission is not None

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    # ---- hosting ----

    @classmethod
    def host(cls, address: str, port: int, identity: Identity, *, members: Mapping[str, int],
             timeout_s: float, engine_ranks: Optional[int] = None,
             secret: Optional[SessionSecret] = None) -> "SyncSession":
        """Host the session (this rank is `identity`, admitted already) and start answering joiners.

        `engine_ranks` (a fleet): inference ranks are not `members`; they join whenever they come, as
        engines of that many ranks (`admitted_engines`). `secret`: every joiner must prove it."""
        session_id = identity.session or new_session_id()
        identity = signed(dataclasses.replace(identity, session=session_id), secret)
        try:
            store = dist.TCPStore(address, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except STORE_ERRORS as e:
            raise RendezvousError(hosting_problem(address, port, e)) from e
        admission = Admission(session_id, identity, dict(members), engine_ranks=engine_ranks, secret=secret)
        session = cls(store, session_id=session_id, identity=identity, address=address, port=port,
                      timeout_s=timeout_s, admission=admission, secret=secret)
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
        except STORE_ERRORS:
            log.exception("the rendezvous at %s cannot answer joiners", self.where)
            return
        for _ in every(ANSWER_EVERY_S, self._stop):
            try:
                count = store.add("rdzv/tickets", 0)
                while self._answered < count:
                    self._take(store, self._answered + 1)
                    self._answered += 1
                self._answer_pending(store)
            except STORE_ERRORS:
                if not self._stop.is_set():
                    log.exception("the rendezvous at %s stopped answering joiners", self.where)
                return

    def _take(self, store: Any, ticket: int) -> None:
        """Answer `ticket` now, or (a fleet engine id another job holds) once that job's ranks answered or not."""
        try:
            identity = Identity.from_json(store.get(f"rdzv/ticket/{ticket}"))
        except (ValueError, TypeError) as e:  # not a megatron-sync rank: refused, and the session goes on
            store.set(f"rdzv/answer/{ticket}", Decision(False, f"ticket {ticket} is not a rank's identity: {e}")
                      .to_json())
            self._replied += 1
            return
        with self._lock:
            seat = self._admission.contested(identity)
        if seat is None:
            self._answer(store, ticket, identity, holder_alive=False)
            return
        query = AliveQuery(store, identity.engine, seat.generation, sorted(seat.ranks), every=False)
        self._pending.append((ticket, identity, query))

    def _answer_pending(self, store: Any) -> None:
        waiting = []
        for ticket, identity, query in self._pending:
            alive = query.answer()
            if alive is None:
                waiting.append((ticket, identity, query))
            else:
                self._answer(store, ticket, identity, holder_alive=alive)
        self._pending = waiting

    def _answer(self, store: Any, ticket: int, identity: Identity, *, holder_alive: bool) -> None:
        with self._lock:
            decision = self._admission.decide(identity, holder_alive=holder_alive)
            failure = self._admission.failure
        store.set(f"rdzv/answer/{ticket}", decision.to_json())
        self._replied += 1
        if decision.fatal and failure == decision.reason:
            store.set("rdzv/failed", failure.encode())
        log_decision(self.id, identity, decision)

    # ---- joining ----

    @classmethod
    def join(cls, address: str, port: int, identity: Identity, *, timeout_s: float,
             secret: Optional[SessionSecret] = None) -> "SyncSession":
        """Join the session hosted at address:port as `identity` (proving `secret`, after checking the host
        proves it too); raise RendezvousError if refused. A fleet's engine rank answers the host's "are you
        there" from then on."""
        where = f"{address}:{port}"
        store = connect(address, port, timeout_s=timeout_s)
        try:
            host = Identity.from_json(read(store, "rdzv/session", where))
            decision = present(store, identity, where, timeout_s, secret=secret, host=host)
        except BaseException:
            store.close()
            raise
        if not decision.accepted:
            store.close()
            raise RendezvousError(f"the rendezvous at {where} refused this rank: {decision.reason}")
        log.info("%s joined session %s", identity.describe(), host.session)
        session = cls(store, session_id=host.session, identity=identity, address=address, port=port,
                      timeout_s=timeout_s, host=host, secret=secret)
        session.generation = decision.generation
        if identity.engine is not None and decision.generation is not None:
            try:
                session._answers = EngineAnswers(address, port, engine=identity.engine,
                                                 generation=decision.generation, rank=identity.member,
                                                 timeout_s=timeout_s)
            except STORE_ERRORS as e:
                session.close()
                raise RendezvousError(f"{identity.describe()} was admitted but cannot open its second connection "
                                      f"to the rendezvous at {where}: {e}") from e
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
            failure = read(self.store, "rdzv/failed", self.where)
            if failure is not None:
                add(self.store, "rdzv/acks", 1)
                raise RendezvousError(f"[{self.identity.describe()}] session {self.id} failed: {failure.decode()}")
            return read(self.store, "rdzv/ready", self.where) is not None

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
                present(self.store, dataclasses.replace(self.identity, failure=reason), self.where,
                        min(self.timeout_s, PROBE_S), secret=self._secret, host=self.host_identity)
        except (RendezvousError, *STORE_ERRORS):
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
        if self._answers is not None:
            self._answers.close(self.store)
            self._answers = None
        self.store.close()
        self.store = None

    def _linger_if_failed(self, linger_s: float) -> None:
        # Every answer and every admitted rank's sight of the failure is acknowledged ("acks"): wait for them,
        # and for the ranks that have not presented themselves yet (they are answered with the failure).
        def told_everyone() -> bool:
            with self._lock:
                if self._admission.failure is None or self._ready:
                    return True
                expected = self._replied + sum(len(m) for m in self._admission.admitted.values()) - 1
                everyone = self._admission.all_presented
            return everyone and add(self.store, "rdzv/acks", 0) >= expected

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


