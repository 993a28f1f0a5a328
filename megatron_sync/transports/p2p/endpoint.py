"""What the P2P sender and receiver use of their transport endpoint (`transport.P2PTransport` is one)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from megatron_sync.session.group import TransportGroup
from megatron_sync.transports.p2p.movers import ByteMover


class P2PEndpoint(Protocol):
    """One rank of a P2P transport: the trainer ranks first, then the inference ranks."""

    rank: int
    world_size: int
    num_trainer_ranks: int
    group: TransportGroup
    mover: ByteMover

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every rank's `obj`, by rank."""

    def agree(self, error: Optional[str], *, what: str, failure: Optional[Callable] = None) -> None:
        """Share this rank's `error` with every rank; all raise if any failed."""
