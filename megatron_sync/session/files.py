"""The sync session over a shared directory: the rendezvous protocol, through files.

A transport that needs no network between the jobs (disk delta) meets in a
directory both can read and write. It passes through the same protocol as the
transports that meet at the rendezvous store (`rendezvous.py`): the trainer's
leader states its `Identity` (signed with the session secret, `secret.py`),
every inference rank presents its own, and the leader answers each with
`Admission.decide` — the same settings compared, the same model fields, the same
refusals worded the same way, the same secret proofs. Only the medium differs:

    <control_dir>/
      session.json             the live session: the host's identity and the transport's details
      <session id>/
        tickets/<name>         a rank's presented identity (name: role-member-nonce, fresh per presentation)
        answers/<name>         the host's `Decision` on it
        ready | failed         every rank was admitted / why the session failed (quoted by every waiting rank)
        board/...              its board's keys (`Directory`): the control channel, reports, gathers

A rank proceeds only on an answer to its own fresh ticket, so a session left
over by an earlier run is never mistaken for the live one; when the live
trainer opens its session the rank presents itself there. A new session
replaces the old one, and the old one's ranks notice (`liveness_check`) and stop
with a PeerFailureError, as they would when a TCP store vanishes. A directory
session has no process group, so the transport backend is not compared.

Files are written with a rename, so a reader sees a message complete or not at
all. On NFS, mount with `lookupcache=positive` (or a short `acdirmin`) so a new
file is seen promptly; coherent parallel file systems need nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Mapping, Optional

from megatron_sync.core.errors import PeerFailureError, RendezvousError
from megatron_sync.core.wait import Deadline, WaitTimeout, clock, poll
from megatron_sync.session.board import Board
from megatron_sync.session.rendezvous import Admission, Decision, Identity, host_unproven, signed
from megatron_sync.session.secret import SessionSecret, new_nonce
from megatron_sync.session.session import log_decision, new_session_id

log = logging.getLogger("megatron_sync")

SESSION = "session.json"
LIVENESS_EVERY_S = 1.0  # how often a waiting rank re-reads session.json (and asks whether its peer is gone)
NOT_COMPARED = ("backend",)  # no process group spans a directory session
_KEY_PART = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class FileSession:
    """One trainer run's session in `control_dir`: the host's identity and what its transport announces."""

    id: str
    control_dir: str
    host: Identity
    details: Mapping[str, Any]  # the transport's own facts for every rank (disk delta: its version offset)

    @property
    def folder(self) -> str:
        return os.path.join(self.control_dir, self.id)

    def to_json(self) -> bytes:
        return json.dumps({"host": dataclasses.asdict(self.host), "details": dict(self.details)}).encode()


def read_session(control_dir: str) -> Optional[FileSession]:
    """Return the session `control_dir/session.json` announces (None when there is none, or it is being
    replaced, or it was written by an older release of this library)."""
    raw = _read(os.path.join(control_dir, SESSION))
    try:
        obj = json.loads(raw) if raw is not None else None
        host = Identity(**obj["host"]) if obj is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    return None if host is None or host.session is None else FileSession(host.session, control_dir, host,
                                                                            dict(obj.get("details", {})))


def _post(path: str, data: bytes) -> None:
    """Write `data` to `path` at once (a rename: readers see all of it or nothing); no fsync (control data)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclasses.dataclass(frozen=True)
class FileRendezvous:
    """What one rank presents at a directory session (`presenting` builds it), and how long it waits."""

    identity: Identity
    timeout_s: float
    secret: Optional[SessionSecret] = dataclasses.field(default=None, repr=False)

    def host(self, control_dir: str, *, members: Mapping[str, int], details: Mapping[str, Any]) -> FileSession:
        """Open a new session in `control_dir` (the trainer's leader, admitted already) and answer every ticket
        until each of `members` (role -> ranks) was admitted; replaces any earlier session (one trainer per
        directory: the caller holds what makes it the only one). Raises RendezvousError quoting a fatal
        refusal, or naming the ranks that did not come within `timeout_s`."""
        session_id = self.identity.session or new_session_id()
        me = signed(dataclasses.replace(self.identity, session=session_id), self.secret)
        session = FileSession(session_id, control_dir, me, dict(details))
        shutil.rmtree(session.folder, ignore_errors=True)  # a run_id reused: its earlier tickets are void
        os.makedirs(os.path.join(session.folder, "tickets"))
        _post(os.path.join(control_dir, SESSION), session.to_json())
        for name in os.listdir(control_dir):
            path = os.path.join(control_dir, name)
            if name != session.id and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)  # earlier runs' sessions; their ranks see session.json change
        admission = Admission(session_id, me, dict(members), secret=self.secret)
        answered: set[str] = set()

        def everyone_admitted() -> bool:
            for name in sorted(_tickets(session) - answered):
                _post(os.path.join(session.folder, "answers", name), _answer(admission, session, name).to_json())
                answered.add(name)
            if admission.failure is not None:
                _post(os.path.join(session.folder, "failed"), admission.failure.encode())
                raise RendezvousError(f"[session {session_id}] {admission.failure}")
            return admission.complete

        poll(everyone_admitted, within=self.timeout_s, what="every rank joining the directory session",
             timeout=lambda _: _nobody_came(session, admission, self.timeout_s))
        _post(os.path.join(session.folder, "ready"), b"1")
        return session

    def join(self, control_dir: str) -> FileSession:
        """Present this rank to the live session in `control_dir` and wait until it is ready; raise
        RendezvousError when refused or when the session failed (quoting why), or when no trainer admitted
        this rank within `timeout_s`."""
        deadline = Deadline.after(self.timeout_s)
        ticket = _Ticket(self, control_dir)
        session = poll(ticket.answered, within=deadline, what="a trainer admitting this rank",
                       timeout=lambda _: ticket.unanswered())
        where = f"[{self.identity.describe()}] session {session.id} in {control_dir}"

        def ready() -> bool:
            failed = _read(os.path.join(session.folder, "failed"))
            if failed is not None:
                raise RendezvousError(f"{where} failed: {failed.decode()}")
            liveness_check(session)()
            return _read(os.path.join(session.folder, "ready")) is not None

        poll(ready, within=deadline, what="the directory session becoming ready", timeout=lambda _: RendezvousError(
            f"{where} was not ready within {self.timeout_s:g}s: the trainer is still starting, or some rank "
            "never joined"))
        return session


def presenting(identity: Identity, *, timeout_s: float, secret: Optional[SessionSecret] = None) -> FileRendezvous:
    """Return what a rank presents at a directory session: `identity` without the rows a directory session does
    not compare (`NOT_COMPARED`)."""
    expects = {key: value for key, value in identity.expects.items() if key not in NOT_COMPARED}
    return FileRendezvous(dataclasses.replace(identity, expects=expects), timeout_s, secret)


def _tickets(session: FileSession) -> set[str]:
    """Return the names of the tickets posted so far (a ticket being written is a hidden temporary file)."""
    return {name for name in os.listdir(os.path.join(session.folder, "tickets")) if not name.startswith(".")}


def _answer(admission: Admission, session: FileSession, name: str) -> Decision:
    raw = _read(os.path.join(session.folder, "tickets", name))
    try:
        joiner = Identity.from_json(raw or b"")
    except (ValueError, TypeError) as e:  # not a megatron-sync rank: refused, and the session goes on
        return Decision(False, f"ticket {name} is not a rank's identity: {e}")
    decision = admission.decide(joiner)
    log_decision(session.id, joiner, decision)
    return decision


def _nobody_came(session: FileSession, admission: Admission, timeout_s: float) -> RendezvousError:
    """Fail the session for the ranks that never presented themselves; return the error."""
    missing = {role: sorted(set(range(count)) - set(admission.admitted.get(role, {})))
               for role, count in admission.members.items()}
    waiting = "; ".join(f"{role} ranks {ranks}" for role, ranks in missing.items() if ranks)
    problem = (f"not every rank joined the directory session in {session.control_dir} within {timeout_s:g}s: "
               f"still missing {waiting}. Start the other job with the same shared directory (and its count of "
               "ranks)")
    _post(os.path.join(session.folder, "failed"), problem.encode())
    return RendezvousError(f"[session {session.id}] {problem}")


class _Ticket:
    """A joiner's presentation: posted afresh to each live session it sees, answered by that session's host."""

    def __init__(self, rendezvous: FileRendezvous, control_dir: str) -> None:
        self.rendezvous, self.control_dir = rendezvous, control_dir
        self.session: Optional[FileSession] = None  # where it is posted
        self.name = ""
        self.passed_over: Optional[str] = None  # why the last session seen was not presented to (or not answered)

    def answered(self) -> Optional[FileSession]:
        """Post to the live session if not yet posted there; return it once its host admitted this rank."""
        live = read_session(self.control_dir)
        if live is not None and (self.session is None or live.id != self.session.id):
            self._present(live)
        if self.session is None:
            return None
        raw = _read(os.path.join(self.session.folder, "answers", self.name))
        if raw is None:
            self._failed(self.session)
            return None
        decision = Decision.from_json(raw)
        if not decision.accepted:
            raise RendezvousError(f"the directory session in {self.control_dir} refused this rank: {decision.reason}")
        return self.session

    def _failed(self, session: FileSession) -> bool:
        """Return whether `session` failed before answering, noting why: a failed session may be an earlier
        run's, so the rank waits for a newer one and quotes the failure if none comes."""
        failed = _read(os.path.join(session.folder, "failed"))
        if failed is not None:
            self.passed_over = f"session {session.id} in {self.control_dir} failed: {failed.decode()}"
        return failed is not None

    def _present(self, live: FileSession) -> None:
        rendezvous = self.rendezvous
        self.passed_over = host_unproven(live.host, rendezvous.secret, f"{self.control_dir}")
        if self.passed_over is not None or self._failed(live):
            return  # another run's leftover, or a misconfigured trainer: said if nothing better comes
        me = signed(dataclasses.replace(rendezvous.identity, nonce=new_nonce()), rendezvous.secret, host=live.host)
        name = f"{me.role}-{me.member}-{me.nonce}"
        try:
            _post(os.path.join(live.folder, "tickets", name), me.to_json())
        except (FileNotFoundError, NotADirectoryError):
            return  # that session's folder is being removed: a newer one is on its way
        self.session, self.name = live, name

    def unanswered(self) -> RendezvousError:
        me, limit = self.rendezvous.identity, self.rendezvous.timeout_s
        if self.passed_over is not None:
            return RendezvousError(f"[{me.describe()}] {self.passed_over}; no newer session came within {limit:g}s")
        if self.session is None:
            return RendezvousError(
                f"[{me.describe()}] no trainer opened a session in {self.control_dir} within {limit:g}s; start the "
                "training job with the same shared directory (its first stage opens the session)")
        return RendezvousError(f"[{me.describe()}] the trainer of session {self.session.id} in {self.control_dir} "
                               f"did not answer within {limit:g}s: it is gone or stopped, or is a later run's")


def liveness_check(session: FileSession, gone: Callable[[], Optional[str]] = lambda: None) -> Callable[[], None]:
    """Return a check that raises PeerFailureError once `session` is no longer the live one, and the error
    `gone` describes once the peer is known to be gone (`gone` returns why, or None)."""

    def check() -> None:
        live = read_session(session.control_dir)
        if live is None or live.id != session.id:
            raise PeerFailureError(
                f"the session {session.id} in {session.control_dir} is over: a new trainer run opened "
                f"{live.id if live else 'none'}; restart the inference job to join it")
        why = gone()
        if why is not None:
            raise PeerFailureError(why)

    return check


class Directory:
    """A board's medium (`board.Board`) over files under `folder`/board: a key is a relative path, a value a
    file written by rename. `alive`, when given, is called about once a second while a fetch waits, and
    raises when the peer that should post is known to be gone."""

    errors: tuple[type[BaseException], ...] = ()  # a file system's errors are the caller's to see as they are

    def __init__(self, folder: str, alive: Optional[Callable[[], None]] = None) -> None:
        self.folder, self._alive = folder, alive

    def _path(self, key: str) -> str:
        parts = key.split("/")
        assert all(_KEY_PART.fullmatch(p) for p in parts), f"control key {key!r} is not a safe relative path"
        return os.path.join(self.folder, "board", *parts)

    def set(self, key: str, value: bytes) -> None:
        _post(self._path(key), value)

    def wait(self, key: str, deadline: Deadline, max_pause_s: float) -> Optional[bytes]:
        path, checked = self._path(key), [clock().now()]

        def posted() -> Optional[bytes]:
            value = _read(path)
            if value is None and self._alive is not None and clock().now() - checked[0] > LIVENESS_EVERY_S:
                self._alive()
                checked[0] = clock().now()
            return value

        try:
            return poll(posted, within=deadline, what=f"a value under {path}", max_pause_s=max_pause_s)
        except WaitTimeout:
            return None

    def delete(self, key: str) -> None:
        """Delete what was posted under `key`, and its folder once empty."""
        path = self._path(key)
        try:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # already gone, or the folder still holds other ranks' posts

    def close(self) -> None:
        self._alive = None


def directory_board(folder: str, *, rank: int, timeout_s: float, alive: Optional[Callable[[], None]] = None) -> Board:
    """Return a board over files in `folder` (`Directory`)."""
    return Board(Directory(folder, alive), rank=rank, timeout_s=timeout_s)
