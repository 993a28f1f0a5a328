"""Control through the shared directory: sessions, a file board, and an all-gather over files.

The disk-delta transport needs no network between the trainer and the
engines: besides the versions themselves, its small control data (sync v,
stop, application messages, reports, the engines' agreement rounds) are files
in the same shared directory.

    <delta_dir>/control/
      session.json             the live session: id, version offset, stages, inference ranks
      <session id>/
        joined/<rank>          an inference rank's join token (a fresh nonce)
        started                the leader's answer: the tokens it accepted, by rank
        board/...              the `StoreControlChannel` keys (control/<n>, report/...) and gathers

A session is what a TCP rendezvous gives the other transports: the trainer's
leader opens one (`open_session`) and waits until every inference rank joined
(`join_session`); an inference rank proceeds once the leader's `started`
carries its own token, so a session left over by an earlier run is never
mistaken for the live one. A new session replaces the old one; inference ranks
of the old one notice (`DirectoryBoard` checks `session.json` while it waits)
and stop with a PeerFailureError, as they would when a TCP store vanishes. A
trainer that exits or dies releases its writers' locks, and the waiting ranks
notice that too (`trainer_gone`), within about `LIVENESS_EVERY_S`.

Files are written with a rename, so a reader sees a message complete or not
at all. On NFS, mount with `lookupcache=positive` (or a short `acdirmin`) so a
new file is seen promptly; coherent parallel file systems need nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import uuid
from typing import Any, Callable, Optional, Sequence

import megatron_sync.transports.disk_delta.fsio as fsio
import megatron_sync.transports.disk_delta.storedir as storedir
from megatron_sync.core.wait import clock, poll
from megatron_sync.core.errors import PeerFailureError, TrainerGoneError

SESSION = "session.json"
_KEY_PART = re.compile(r"[A-Za-z0-9._-]+")
LIVENESS_EVERY_S = 1.0  # how often a waiting rank re-reads session.json


@dataclasses.dataclass(frozen=True)
class Session:
    """One trainer run's control session in `control_dir`."""

    id: str
    control_dir: str
    version_offset: int  # store version = the trainer's sync count + this (the store's latest when it opened)
    num_stages: int
    num_inference_ranks: int

    @property
    def folder(self) -> str:
        return os.path.join(self.control_dir, self.id)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "version_offset": self.version_offset, "num_stages": self.num_stages,
                "num_inference_ranks": self.num_inference_ranks}


def read_session(control_dir: str) -> Optional[Session]:
    """Return the session `control_dir/session.json` announces (None when there is none or it is being replaced)."""
    try:
        with open(os.path.join(control_dir, SESSION)) as f:
            obj = json.load(f)
        return Session(str(obj["id"]), control_dir, int(obj["version_offset"]), int(obj["num_stages"]),
                       int(obj["num_inference_ranks"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _post(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fsio.write_atomic(path, data, durable=False)


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def open_session(control_dir: str, *, version_offset: int, num_stages: int, num_inference_ranks: int,
                 timeout_s: float) -> Session:
    """Open a new session (the trainer's leader) and wait until every inference rank joined it.

    Replaces any earlier session (one trainer per store: the caller holds stage 0's writer lock).
    Raises PeerFailureError naming the ranks that did not join within `timeout_s`.
    """
    session = Session(f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}", control_dir, version_offset,
                      num_stages, num_inference_ranks)
    os.makedirs(session.folder)
    fsio.write_json_atomic(os.path.join(control_dir, SESSION), session.to_json())
    for name in os.listdir(control_dir):
        path = os.path.join(control_dir, name)
        if name != session.id and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)  # earlier runs' sessions; their ranks see session.json change
    tokens: dict[int, str] = {}

    def everyone_joined() -> bool:
        for rank in set(range(num_inference_ranks)) - set(tokens):
            raw = _read(os.path.join(session.folder, "joined", str(rank)))
            if raw is not None:
                tokens[rank] = raw.decode()
        return len(tokens) == num_inference_ranks

    poll(everyone_joined, within=timeout_s, what="the inference ranks joining", timeout=lambda _: PeerFailureError(
        f"[trainer leader] inference ranks {sorted(set(range(num_inference_ranks)) - set(tokens))} did not join the "
        f"disk-delta session in {control_dir} within {timeout_s:g}s; start the inference job with the same "
        f"delta_dir and num_inference_ranks={num_inference_ranks}"))
    _post(os.path.join(session.folder, "started"), json.dumps(tokens).encode())
    return session


def join_session(control_dir: str, *, inference_rank: int, num_stages: int, num_inference_ranks: int,
                 timeout_s: float) -> Session:
    """Join the live session as `inference_rank`: wait until a leader accepted this rank's fresh token.

    A session.json left by an earlier run is joined too, but its `started` never carries this
    token; when the live trainer opens its session, the rank joins that one instead.
    """
    token = uuid.uuid4().hex
    joined: Optional[Session] = None

    def admitted() -> Optional[Session]:
        nonlocal joined
        session = read_session(control_dir)
        if session is not None and (joined is None or session.id != joined.id):
            try:
                _post(os.path.join(session.folder, "joined", str(inference_rank)), token.encode())
                joined = session
            except (FileNotFoundError, NotADirectoryError):
                pass  # that session's folder is being removed: a newer one is on its way
        if joined is not None:
            started = _read(os.path.join(joined.folder, "started"))
            if started is not None and json.loads(started).get(str(inference_rank)) == token:
                _check_shape(joined, num_stages, num_inference_ranks)
                return joined
        return None

    return poll(admitted, within=timeout_s, what="a trainer opening the session", timeout=lambda _: PeerFailureError(
        f"[inference rank {inference_rank}] no trainer opened a disk-delta session in {control_dir} within "
        f"{timeout_s:g}s; start the training job with the same delta_dir (its stage 0 source opens it)"))


def _check_shape(session: Session, num_stages: int, num_inference_ranks: int) -> None:
    if (session.num_stages, session.num_inference_ranks) != (num_stages, num_inference_ranks):
        raise ValueError(
            f"the trainer's session has {session.num_stages} stage(s) and {session.num_inference_ranks} inference "
            f"rank(s), this inference job {num_stages} and {num_inference_ranks}: pass --trainer-stages "
            f"{session.num_stages} and the trainer's num_inference_ranks")


def liveness_check(session: Session, stores: Sequence[str] = ()) -> Callable[[], None]:
    """Return a check that raises PeerFailureError once `session` is no longer the live one, and
    TrainerGoneError once a stage's writer of `stores` is gone (`trainer_gone`)."""

    def check() -> None:
        live = read_session(session.control_dir)
        if live is None or live.id != session.id:
            raise PeerFailureError(
                f"the disk-delta session {session.id} in {session.control_dir} is over: a new trainer run opened "
                f"{live.id if live else 'none'}; restart the inference job to join it")
        gone = trainer_gone(stores)
        if gone is not None:
            raise TrainerGoneError(gone)

    return check


def trainer_gone(stores: Sequence[str]) -> Optional[str]:
    """Return why the trainer is gone when a stage's store has no live writer (its process exited or died,
    which releases the writer lock), else None."""
    for store in stores:
        if not storedir.writer_running(store):
            return (f"the trainer is gone: no process holds {os.path.join(store, storedir.WRITER_LOCK)} (the "
                    "trainer's delta writer of that stage exited or was killed)")
    return None


class DirectoryBoard:
    """`post` / `fetch` small control data as files under `folder` (the StoreBoard interface, over a directory).

    `alive`, when given, is called about once a second while `fetch` waits, and raises when the
    peer that should post is known to be gone.
    """

    def __init__(self, folder: str, *, rank: int, timeout_s: float, alive: Optional[Callable[[], None]] = None):
        self.folder, self.rank, self.timeout_s, self._alive = folder, rank, timeout_s, alive

    def _path(self, key: str) -> str:
        parts = key.split("/")
        assert all(_KEY_PART.fullmatch(p) for p in parts), f"control key {key!r} is not a safe relative path"
        return os.path.join(self.folder, "board", *parts)

    def post(self, key: str, value: bytes) -> None:
        """Publish `value` under `key` (atomic: readers see all of it or nothing)."""
        _post(self._path(key), value)

    def fetch(self, key: str, timeout_s: Optional[float] = None, *, max_pause_s: float = 0.1) -> bytes:
        """Return the value posted under `key`, waiting up to `timeout_s` (None: the board's timeout), looking at
        least every `max_pause_s`."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        path, checked = self._path(key), [clock().now()]

        def posted() -> Optional[bytes]:
            value = _read(path)
            if value is None and self._alive is not None and clock().now() - checked[0] > LIVENESS_EVERY_S:
                self._alive()
                checked[0] = clock().now()
            return value

        return poll(posted, within=limit, what=f"a value under {path}", max_pause_s=max_pause_s, timeout=lambda _: PeerFailureError(
            f"[rank {self.rank}] nothing was posted under {path} within {limit:g}s"))

    def remove(self, key: str) -> None:
        """Delete what was posted under `key` (once every reader has read it), and its folder once empty."""
        path = self._path(key)
        try:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # already gone, or the folder still holds other ranks' posts

    def close(self) -> None:
        self._alive = None


class FileGather:
    """All-gather of one JSON object per rank among `size` ranks, through a board (rounds numbered in order).

    Each rank posts its object for round r and reads everybody's. Once a rank finished round r,
    every rank has posted r, hence finished reading r - 1: the rank then deletes its post of r - 1.
    """

    def __init__(self, board: DirectoryBoard, *, name: str, index: int, size: int) -> None:
        self.board, self.name, self.index, self.size = board, name, index, size
        self._round = 0

    def __call__(self, obj: Any) -> list[Any]:
        self._round += 1
        self.board.post(f"gather/{self.name}/{self._round}/{self.index}", json.dumps(obj).encode())
        values = [json.loads(self.board.fetch(f"gather/{self.name}/{self._round}/{r}")) for r in range(self.size)]
        if self._round > 1:
            self.board.remove(f"gather/{self.name}/{self._round - 1}/{self.index}")
        return values
