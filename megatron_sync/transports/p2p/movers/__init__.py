"""Byte movers: write spans of one registered buffer into a peer's exposed memory.

One small interface, three backends (`weight_sync.p2p.backend`):

- `nixl` (`nixl.NixlMover`): NIXL agents over UCX, one-sided writes from registered memory (DRAM or
  VRAM: a GPU's arena goes straight into the receiving GPU with GPUDirect RDMA). On CPU, UCX's TCP
  transport on loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`) runs every line of the path.
- `mooncake` (`mooncake.MooncakeMover`): Mooncake Transfer Engine, one-sided writes (RDMA, or TCP).
- `torch` (`torch_p2p.TorchMover`): torch.distributed point-to-point on the transport group (gloo or NCCL);
  two-sided, so the receiving side posts its receives (`expect`).

Endpoints are named ("trainer/3", "receiver/5"). A receiver `expose`s its window under its name; a
writer `register`s the buffer it writes from and `write`s spans (source offset in that buffer,
destination offset in the peer's exposed memory, bytes), getting back a `Pending` it can poll. Completion,
checksums and errors travel out of band (the schedule's reports); a mover only moves bytes and counts them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch


@dataclass(frozen=True)
class Span:
    """`nbytes` from offset `src` of the writer's buffer to offset `dst` of the target's exposed memory."""

    src: int
    dst: int
    nbytes: int


class Pending(Protocol):
    """An in-flight write (or posted receive)."""

    def done(self) -> bool:
        """Return True once the bytes arrived (a write's source may then be reused)."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; PeerFailureError when the peer is gone or `timeout_s` passed."""


class Done:
    """A `Pending` that is complete already (one-sided movers have nothing to post on the receiving side)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        return None


class ByteMover(abc.ABC):
    """Moves bytes between registered buffers of this process and its peers; one per process."""

    name: str
    device: torch.device = torch.device("cpu")
    """Where this mover's buffers live (the device checksums run on)."""
    two_sided: bool = False
    """True when every write needs a receive the receiving side posted (`expect`): then every posted
    receive must be matched, by the bytes or by filler (`abandon`), or the pair stays stuck."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Return a flat uint8 buffer of `nbytes` on this mover's device, registered with it."""
        memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.register(memory)
        return memory

    @abc.abstractmethod
    def register(self, memory: torch.Tensor) -> None:
        """Register `memory` (flat uint8) for transfers: a buffer writes read from or land in."""

    @abc.abstractmethod
    def expose(self, name: str, memory: torch.Tensor) -> None:
        """Publish registered `memory` as where writes to endpoint `name` land."""

    @abc.abstractmethod
    def write(self, target: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """Start writing `spans` of registered `memory` into endpoint `target`'s exposed memory."""

    def route(self, prefix: str, board: object) -> None:
        """Publish and look up endpoints named `prefix...` on `board` (a fleet's engines meet across their
        links on the session's root store); only one-sided movers can write across links."""
        raise ValueError(f"the {self.name} backend cannot write into another link's memory: chaining a fleet's "
                         "engines needs p2p_backend 'nixl' or 'mooncake' (or p2p_forward false)")

    def expect(self, source: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """Receiving side: get ready for `source`'s writes of `spans` into `memory` (each span's `dst`);
        two-sided movers post their receives here, one-sided movers have nothing to do."""
        return Done()

    def abandon(self, target: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """A writer that gave up: keep a two-sided receiver in step by sending whatever `memory` holds in place
        of `spans` (the receiver knows from the report that they are not the version). One-sided movers have
        nothing to keep in step."""
        return Done()

    @property
    @abc.abstractmethod
    def bytes_written(self) -> dict[str, int]:
        """Return the bytes written to each target since construction (counted when posted)."""

    def close(self) -> None:
        """Release registrations and connections; safe to call twice."""


def check_inside(memory: torch.Tensor, spans: Sequence[Span], what: str, peer_bytes: Optional[int] = None) -> None:
    """Raise ValueError when a span reads outside `memory` or lands outside the peer's `peer_bytes`."""
    size = memory.numel()
    for s in spans:
        if s.src < 0 or s.src + s.nbytes > size:
            raise ValueError(f"{what}: bytes [{s.src}, +{s.nbytes}) lie outside the {size}-byte buffer written from")
        if peer_bytes is not None and (s.dst < 0 or s.dst + s.nbytes > peer_bytes):
            raise ValueError(f"{what}: bytes [{s.dst}, +{s.nbytes}) land outside the peer's {peer_bytes}-byte window")


def merged(spans: Sequence[Span]) -> list[Span]:
    """Return `spans` with each one that continues the previous at both ends joined to it (fewer
    descriptors per write; consecutive pieces of one placement usually are)."""
    out: list[Span] = []
    for s in spans:
        last = out[-1] if out else None
        if last is not None and last.src + last.nbytes == s.src and last.dst + last.nbytes == s.dst:
            out[-1] = Span(last.src, last.dst, last.nbytes + s.nbytes)
        else:
            out.append(s)
    return out
