"""torch.distributed point-to-point on the transport group (gloo on CPU, NCCL on GPU): two-sided.

The writer sends each span from its buffer; the receiving side posts one receive per span straight into
its window, in the order the writer sends (the schedule's order), so no byte is staged twice. Tensors live
on the group's device; every wait is bounded.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.core.wait import Deadline
from megatron_sync.session.group import TransportGroup
from megatron_sync.transports.p2p.movers import ByteMover, Pending, Span, check_inside


class _Works:
    """Posted sends or receives of one batch."""

    def __init__(self, works: list, what: str) -> None:
        self._works, self._what = works, what

    def done(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float) -> None:
        deadline = Deadline.after(timeout_s)
        try:
            for work in self._works:
                work.wait(max(deadline.remaining(), 0.001))
        except PeerFailureError as e:
            raise PeerFailureError(f"{self._what} failed: {e}") from e


class TorchMover(ByteMover):
    """Point-to-point over `group`; `ranks` maps endpoint names to ranks of the group."""

    name = "torch"
    two_sided = True

    def __init__(self, group: TransportGroup, ranks: Mapping[str, int], *, tag: int = 0) -> None:
        self._group, self._ranks, self.tag = group, dict(ranks), tag
        self.device = group.device
        self._written: dict[str, int] = {}

    def register(self, memory: torch.Tensor) -> None:
        if memory.device != self.device:
            raise ValueError(f"a buffer on {memory.device}: this mover moves {self.device} tensors "
                             f"(weight_sync.backend picks the group's device)")

    def expose(self, name: str, memory: torch.Tensor) -> None:
        self.register(memory)

    def write(self, target: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        check_inside(memory, spans, f"write to {target}")
        peer = self._ranks[target]
        works = [self._group.send(memory[s.src:s.src + s.nbytes], peer, tag=self.tag) for s in spans]
        self._written[target] = self._written.get(target, 0) + sum(s.nbytes for s in spans)
        return _Works(works, f"sending {len(spans)} spans to {target}")

    def abandon(self, target: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        peer = self._ranks[target]
        works = [self._group.send(memory[s.src:s.src + s.nbytes], peer, tag=self.tag) for s in spans]
        return _Works(works, f"sending filler for {len(spans)} spans to {target}")

    def expect(self, source: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        peer = self._ranks[source]
        works = [self._group.recv(memory[s.dst:s.dst + s.nbytes], peer, tag=self.tag) for s in spans]
        return _Works(works, f"receiving {len(spans)} spans from {source}")

    @property
    def bytes_written(self) -> dict[str, int]:
        return dict(self._written)
