"""What one-sided movers (NIXL, Mooncake) share: registrations, published windows, checked writes.

A receiver `expose`s a registered window by posting a description of it (how to reach this process, the
window's address and size) under `<prefix>/<name>` on the control board; a writer fetches it once per
target. Every local byte a write reads must lie in a registered buffer and every byte it writes inside
the target's window: checked here before the backend sees the write, since some transports (Mooncake's
TCP) would accept an unregistered source that RDMA rejects.
"""

from __future__ import annotations

import abc
import json
from typing import Any, Sequence

import torch

from megatron_sync.transports.p2p.movers import ByteMover, Done, Pending, Span, check_inside, merged
from megatron_sync.session.board import Board


class OneSidedMover(ByteMover):
    """A mover whose writes land in a peer's registered memory without the peer taking part."""

    def __init__(self, board: Board, *, prefix: str, timeout_s: float) -> None:
        self._board, self._prefix, self.timeout_s = board, prefix, timeout_s
        self._boards: dict[str, Board] = {}  # endpoint name prefix -> the board such endpoints meet on
        self._registered: list[tuple[int, int, Any]] = []  # (address, bytes, the backend's handle)
        self._peers: dict[str, dict] = {}
        self._written: dict[str, int] = {}

    # ---- what a backend provides ----

    @abc.abstractmethod
    def _register(self, memory: torch.Tensor) -> Any:
        """Register `memory` with the backend; return what `_unregister` needs."""

    @abc.abstractmethod
    def _unregister(self, handle: Any) -> None:
        """Undo one `_register`."""

    @abc.abstractmethod
    def _whoami(self, memory: torch.Tensor) -> dict:
        """Return what a writer needs to reach `memory` in this process (beside its address and size)."""

    @abc.abstractmethod
    def _start_write(self, peer: dict, sources: list[int], destinations: list[int], lengths: list[int],
                     memory: torch.Tensor, target: str) -> Pending:
        """Start the backend's write of absolute addresses (sources local, destinations the peer's)."""

    # ---- the mover ----

    def register(self, memory: torch.Tensor) -> None:
        if memory.device != self.device:
            raise ValueError(f"a buffer on {memory.device}: this {self.name} mover registers {self.device} memory")
        address = memory.data_ptr()
        if any(address == a for a, _, _ in self._registered):
            return
        self._registered.append((address, memory.numel(), self._register(memory)))

    def route(self, prefix: str, board: Board) -> None:
        self._boards[prefix] = board

    def _board_of(self, name: str) -> Board:
        return next((board for prefix, board in self._boards.items() if name.startswith(prefix)), self._board)

    def expose(self, name: str, memory: torch.Tensor) -> None:
        self.register(memory)
        desc = {**self._whoami(memory), "addr": memory.data_ptr(), "nbytes": memory.numel()}
        self._board_of(name).post(f"{self._prefix}/{name}", json.dumps(desc).encode())

    def _peer(self, target: str) -> dict:
        if target not in self._peers:
            raw = self._board_of(target).fetch(f"{self._prefix}/{target}", self.timeout_s)
            self._peers[target] = json.loads(raw)
        return self._peers[target]

    def forget(self, target: str) -> None:
        """Drop what was fetched of `target` (a restarted peer exposes a new window)."""
        self._peers.pop(target, None)

    def write(self, target: str, memory: torch.Tensor, spans: Sequence[Span]) -> Pending:
        if not spans:  # an empty round (heads share round ends): a backend's empty transfer may never complete
            return Done()
        peer = self._peer(target)
        spans = merged(spans)
        check_inside(memory, spans, f"write to {target}", peer["nbytes"])
        base = memory.data_ptr()
        self._check_registered(base, memory.numel(), target)
        pending = self._start_write(peer, [base + s.src for s in spans], [peer["addr"] + s.dst for s in spans],
                                    [s.nbytes for s in spans], memory, target)
        self._written[target] = self._written.get(target, 0) + sum(s.nbytes for s in spans)
        return pending

    def _check_registered(self, address: int, nbytes: int, target: str) -> None:
        if not any(a <= address and address + nbytes <= a + n for a, n, _ in self._registered):
            raise ValueError(f"write to {target}: the buffer at {address:#x} (+{nbytes}) is not registered with "
                             f"the {self.name} mover; register it first (RDMA rejects unregistered memory)")

    @property
    def bytes_written(self) -> dict[str, int]:
        return dict(self._written)

    def close(self) -> None:
        for _, _, handle in self._registered:
            self._unregister(handle)
        self._registered = []

