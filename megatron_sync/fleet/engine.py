"""An engine's side of a fleet: wait for its link, say what it holds, relay to and from other engines.

An engine job of a fleet (`weight_sync.fleet: true`, `engine_id`) joins the session like any inference job,
is admitted as its engine's latest generation, then waits until the trainer's leader opens its link at a sync
boundary (`trainer.OPEN_KEY`), connects over its own part of the session, agrees on the plan and tells the
trainer its layout digest and whether it can relay (`hello`). Relays are control messages on its link:
RELAY_SEND (send the committed version to another engine) and RELAY_RECEIVE (take it from one and commit).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PeerFailureError, RendezvousError
from megatron_sync.fleet.links import link_name
from megatron_sync.fleet.relay import receive_live_set, send_live_set
from megatron_sync.fleet.membership import OPEN_KEY
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.session.control import ControlMessage
from megatron_sync.session.board import store_board

log = logging.getLogger("megatron_sync")


def await_link(session: Any, engine: int, idle_timeout_s: float) -> str:
    """Wait (up to `idle_timeout_s`; a trainer gone or silent is noticed within the session's timeout_s) until
    the leader opens this engine's link; return the session part to connect over."""
    board = store_board(session.store, prefix="", rank=0, timeout_s=session.timeout_s)
    answer = board.fetch(OPEN_KEY.format(engine=engine, generation=session.generation), timeout_s=idle_timeout_s)
    if answer != b"open":
        raise RendezvousError(f"engine {engine} (generation {session.generation}): the trainer will not link this "
                              f"job: {answer.decode(errors='replace')}")
    return link_name(engine, session.generation)


def hello(transport: Any, receiver: Any, *, relays: bool = True) -> None:
    """Tell the trainer's stage sources this rank's layout digest and whether it can relay (link handshake):
    `relays` False for an engine driven over its own API, whose workers do not read the link's control."""
    transport.all_gather_json({"layout": receiver.layout.digest(),
                               "relays": relays and hasattr(receiver, "live_set")})


class Relays:
    """The relay messages of one engine rank (`rank` of `ranks`) in a fleet."""

    def __init__(self, session: Any, receiver: Any, transport: Any, config: Any, *, rank: int, ranks: int) -> None:
        self.session, self.receiver, self.transport, self.config = session, receiver, transport, config
        self.rank, self.ranks = rank, ranks
        self.algorithm = resolve_checksum(config.checksum, torch.device("cpu"))
        self.backend = config.resolved_backend(torch.cuda.is_available())

    def send(self, message: ControlMessage) -> None:
        """Send the committed version to engine payload["to"], then agree with the trainer that it went.
        A failure here is this relay's alone (the destination falls back to the trainer); a dead link raises."""
        to, part = message.payload["to"], self.session.part(message.payload["part"])
        error: Optional[str] = None
        try:
            sent = send_live_set(part, ranks=self.ranks, rank=self.rank, live=self.receiver.live_set(),
                                 layout=self.receiver.layout.digest(), algorithm=self.algorithm,
                                 backend=self.backend, timeout_s=self.config.timeout_s)
            log.info("[engine rank %d] relayed version %d to engine %s (%d bytes)", self.rank, message.version, to,
                     sent)
        except Exception as e:  # noqa: BLE001 — agreed below, then the trainer falls back
            error = f"relay to engine {to}: {describe(e, limit=2)}"
        try:
            self.transport.agree(error, what=f"relay of version {message.version} to engine {to}")
        except PeerFailureError:
            raise
        except Exception as e:  # noqa: BLE001 — the relay failed; this engine serves on
            log.warning("[engine rank %d] the relay of version %d to engine %s failed: %s", self.rank,
                        message.version, to, str(e).splitlines()[0])

    def receive(self, message: ControlMessage) -> SyncMetrics:
        """Receive `message.version` from engine payload["from"] into the free staging set and commit it with
        the trainer (both rounds over this engine's link)."""
        source, part = message.payload["from"], self.session.part(message.payload["part"])

        def fill(target: torch.Tensor) -> None:
            receive_live_set(part, ranks=self.ranks, rank=self.rank, version=message.version, target=target,
                             layout=self.receiver.layout.digest(), algorithm=self.algorithm, backend=self.backend,
                             timeout_s=self.config.timeout_s)

        metrics = self.receiver.receive_relayed(message.version, fill)
        metrics.source = f"engine {source}"
        return metrics

