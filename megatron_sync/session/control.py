"""The typed control channel between the trainer's leader and the inference ranks.

Messages go one way, numbered, from the leader (stage 0's source) to every
inference rank: sync version v, stop, or an application message the library
only routes (a harness's "verify", say). Reports go the other way, keyed by
kind, version and rank: a receiver's metrics, a stop acknowledgement.

`StoreControlChannel` carries both through the rendezvous store rather than
collectives, so an engine can idle through training steps of any length and
still notice at once when the store's host (the trainer) is gone.
"""

from __future__ import annotations

import abc
import enum
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from megatron_sync.core.wait import Deadline
from megatron_sync.session.board import Board


class ControlOp(str, enum.Enum):
    """What a control message asks of the inference ranks."""

    SYNC = "sync"  # receive and commit `version`
    STOP = "stop"  # acknowledge and leave; the engine keeps the version it holds (payload: optional reason)
    APP = "app"  # an application message: `payload` goes to the application's handler
    RELAY_SEND = "relay_send"  # fleet: send the committed `version` to engine payload["to"] over payload["part"]
    RELAY_RECEIVE = "relay_receive"  # fleet: receive `version` from engine payload["from"] and commit it
    RELEASE = "release"  # free the engine's memory while the trainer trains (megatron_sync.engines.handoff)
    RESTORE = "restore"  # take it back and load the live version again (no sync comes before generation)


class Report(str, enum.Enum):
    """What an inference rank reports back to the leader."""

    METRICS = "metrics"  # SyncMetrics JSON of one committed version
    STOPPED = "stopped"  # the rank read "stop" (payload: the version it holds), or left on its own
    # (payload: b"left: " and why), so the leader closing the session does not wait for it
    RELEASED = "released"  # the rank's handoff row of a release (or its error), JSON
    RESTORED = "restored"  # the rank's handoff row of a restore, at a sync or on "restore" (or its error), JSON


@dataclass(frozen=True)
class ControlMessage:
    """One message from the leader; `payload` (JSON-serialisable): an APP message's content, or a STOP's
    `{"reason": ...}` when the trainer stopped for a reason other than finishing."""

    op: ControlOp
    version: int = 0
    payload: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps({"op": self.op.value, "version": self.version, "payload": self.payload}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ControlMessage":
        d = json.loads(raw.decode())
        return cls(ControlOp(d["op"]), int(d["version"]), dict(d["payload"]))


class ControlChannel(abc.ABC):
    """Messages leader -> inference ranks (in order), reports inference ranks -> leader."""

    @abc.abstractmethod
    def send(self, message: ControlMessage) -> None:
        """Publish the next message to every inference rank (leader only)."""

    @abc.abstractmethod
    def next(self, timeout_s: float) -> ControlMessage:
        """Return the next message, waiting up to `timeout_s` (PeerFailureError if none comes)."""

    @abc.abstractmethod
    def report(self, kind: Report, version: int, rank: int, payload: bytes) -> None:
        """Publish this inference rank's report of `kind` for `version`."""

    @abc.abstractmethod
    def collect(self, kind: Report, version: int, ranks: Iterable[int],
                timeout_s: Optional[float] = None) -> dict[int, bytes]:
        """Return {rank: payload} of every listed rank's report (leader), waiting up to `timeout_s` in all."""


class StoreControlChannel(ControlChannel):
    """A control channel over a board: a rendezvous store's (broadcast) or a shared directory's (disk delta)."""

    def __init__(self, board: Board) -> None:
        self._group = board
        self._sent = 0
        self._received = 0
        self._sending = threading.Lock()  # a fleet's later waves announce from a thread of their own

    def send(self, message: ControlMessage) -> None:
        with self._sending:
            self._sent += 1
            self._group.post(f"control/{self._sent}", message.to_bytes())

    def next(self, timeout_s: float) -> ControlMessage:
        raw = self._group.fetch(f"control/{self._received + 1}", timeout_s=timeout_s)
        self._received += 1
        return ControlMessage.from_bytes(raw)

    def report(self, kind: Report, version: int, rank: int, payload: bytes) -> None:
        self._group.post(f"report/{kind.value}/{version}/{rank}", payload)

    def collect(self, kind: Report, version: int, ranks: Iterable[int],
                timeout_s: Optional[float] = None) -> dict[int, bytes]:
        deadline = Deadline.after(self._group.timeout_s if timeout_s is None else timeout_s)
        return {r: self._group.fetch(f"report/{kind.value}/{version}/{r}", timeout_s=deadline.remaining())
                for r in ranks}
