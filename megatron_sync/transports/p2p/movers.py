"""Byte movers: put a sender's packed message into the planned ranges of a receiver's staging buffer.

Two backends behind one small interface:

- `TorchP2PMover`: torch.distributed point-to-point on the transport group (gloo on CPU, NCCL
  on GPU). Two-sided: the receiver posts one receive per range straight into its staging
  buffer (`expect`), the sender sends each range from its payload (`write`).
- `MooncakeMover`: Mooncake Transfer Engine, one-sided. The receiver registers its staging
  buffer and publishes (session id, address, size) on the control channel (`expose`); the
  sender writes all ranges of a message with one `batch_transfer_sync_write` from its
  registered send buffer. TCP in CI, RDMA in production.

Completion, checksums and errors travel out of band (see `execute`); a mover only moves bytes
and counts what it moved, per peer, at the transport.
"""

from __future__ import annotations

import abc
import json
import time
from typing import Mapping, Protocol, Sequence

import torch

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.transports.p2p.plan import Message, Range
from megatron_sync.session.control import Board
from megatron_sync.session.group import Pending, TransportGroup


class Control(Board, Protocol):
    """The out-of-band channel: a control board (the transport group's `StoreBoard`) that also deletes."""

    def delete(self, key: str) -> None:
        """Remove `key` once consumed."""


class PendingReceives(Protocol):
    """What a receiver waits on after `expect` (nothing for one-sided movers)."""

    def wait(self, timeout_s: float) -> dict[int, int]:
        """Block until every expected byte arrived; return bytes received per sender."""


class ByteMover(abc.ABC):
    """Moves message payloads into receivers' staging buffers; one instance per process."""

    name: str
    device: torch.device = torch.device("cpu")
    """Where this mover's staging and send buffers live (what checksums are computed next to)."""

    @abc.abstractmethod
    def expose(self, receiver: int, staging: torch.Tensor) -> None:
        """Receiver: make `staging` (flat uint8) the target of this receiver's writes."""

    @abc.abstractmethod
    def expect(self, receiver: int, messages: Sequence[Message], ranges: Sequence[Range],
               staging: torch.Tensor) -> PendingReceives:
        """Receiver: get ready for `messages` (two-sided movers post their receives here)."""

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        """Receiver: return a flat uint8 buffer of `nbytes` where this mover can deliver bytes (host memory)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    @abc.abstractmethod
    def send_buffer(self, nbytes: int) -> torch.Tensor:
        """Sender: return a flat uint8 buffer of at least `nbytes` that payloads may be packed into."""

    @abc.abstractmethod
    def write(self, message: Message, ranges: Sequence[Range], payload: torch.Tensor, set_offset: int = 0) -> None:
        """Sender: deliver `payload` (the message's ranges back to back) into the receiver's staging, in
        the staging set that starts `set_offset` bytes into what it exposed (each range at `set_offset +
        range.dst`; a two-sided mover's receiver chose the set when it posted its receives).

        Returns once the payload may be reused; raises PeerFailureError when the receiver is gone.
        """

    def abandon(self, message: Message, ranges: Sequence[Range], filler: torch.Tensor) -> None:
        """Sender that failed: keep a two-sided receiver in step by sending `filler` in place of the message.

        One-sided movers have nothing to keep in step; the receiver learns of the failure
        from the sender's report and never commits what is in its staging buffer.
        """

    @property
    @abc.abstractmethod
    def bytes_written(self) -> dict[int, int]:
        """Sender: bytes the transport accepted, per receiver, since construction."""

    def close(self) -> None:
        """Release registrations and buffers."""


# ---- torch.distributed ------------------------------------------------------------------------

class _TorchReceives:
    """Posted receives; those that never complete are parked on the mover, so their buffers outlive them."""

    def __init__(self, works: list[tuple[int, int, Pending]], parked: list):
        self._works, self._parked = works, parked

    def wait(self, timeout_s: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        got: dict[int, int] = {}
        for k, (sender, nbytes, work) in enumerate(self._works):
            try:
                work.wait(max(deadline - time.monotonic(), 0.001))
            except PeerFailureError as e:
                self._parked.extend(w for _, _, w in self._works[k:])
                self._works = []
                raise PeerFailureError(f"receiving {nbytes} bytes from trainer rank {sender} failed: {e}") from e
            got[sender] = got.get(sender, 0) + nbytes
        self._works = []
        return got


class TorchP2PMover(ByteMover):
    """Point-to-point over a transport group (`TransportGroup.send` / `recv`: gloo or NCCL).

    `peer_ranks` maps ("sender", trainer rank) and ("receiver", receiver index) to ranks of
    the group. Tensors live on the group's device (CPU for gloo, CUDA for NCCL); every wait
    is bounded by the group's timeout.
    """

    name = "torch"

    def __init__(self, group: TransportGroup, peer_ranks: Mapping[tuple[str, int], int], *, tag: int = 0):
        self._group, self._peers = group, dict(peer_ranks)
        self.device, self.timeout_s, self.tag = group.device, group.timeout_s, tag
        self._written: dict[int, int] = {}
        self._buffer: torch.Tensor | None = None
        self._parked: list = []  # receives a dead or silent sender never completed

    def expose(self, receiver: int, staging: torch.Tensor) -> None:
        if staging.device != self.device:
            raise ValueError(f"staging is on {staging.device}, this mover moves {self.device} tensors")

    def expect(self, receiver, messages, ranges, staging) -> PendingReceives:
        works = []
        for m in messages:
            for i in m.ranges:
                r = ranges[i]
                work = self._group.recv(staging[r.dst:r.dst + r.nbytes], self._peers[("sender", m.sender)], tag=self.tag)
                works.append((m.sender, r.nbytes, work))
        return _TorchReceives(works, self._parked)

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def send_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def write(self, message, ranges, payload, set_offset: int = 0) -> None:
        self._send(message, ranges, payload)
        self._written[message.receiver] = self._written.get(message.receiver, 0) + message.nbytes

    def abandon(self, message, ranges, filler) -> None:
        self._send(message, ranges, filler)

    def _send(self, message: Message, ranges: Sequence[Range], payload: torch.Tensor) -> None:
        dst, at, works = self._peers[("receiver", message.receiver)], 0, []
        try:
            for i in message.ranges:
                n = ranges[i].nbytes
                works.append(self._group.send(payload[at:at + n], dst, tag=self.tag))
                at += n
            for work in works:
                work.wait()
        except PeerFailureError as e:
            raise PeerFailureError(f"sending message {message.index} to receiver {message.receiver} failed: {e}") from e

    @property
    def bytes_written(self) -> dict[int, int]:
        return dict(self._written)


# ---- Mooncake Transfer Engine -----------------------------------------------------------------

def _transfer_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(
            f"the Mooncake backend needs the Mooncake Transfer Engine ({e}); install "
            "mooncake-transfer-engine (CUDA/RDMA hosts) or mooncake-transfer-engine-non-cuda (CPU, TCP), "
            "and the system library libibverbs1"
        ) from e
    return TransferEngine


def count_hcas(topology_json: str) -> int:
    """Return the number of distinct RDMA devices in Mooncake's `get_local_topology()` JSON."""
    topology = json.loads(topology_json or "{}")
    devices = {hca for lists in topology.values() for hcas in lists for hca in hcas}
    return len(devices)


class MooncakeMover(ByteMover):
    """One-sided writes through Mooncake's Transfer Engine (P2P handshake, no metadata server).

    `protocol` is "tcp" or "rdma"; with "rdma" and no RDMA device this raises instead of
    Mooncake's silent fallback to TCP. Every local buffer a write reads from must be
    registered (RDMA enforces it, Mooncake's TCP does not, so this class checks it).
    """

    name = "mooncake"

    def __init__(self, control: Control, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", timeout_s: float = 300.0, key_prefix: str = "p2p/mooncake"):
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol={protocol!r}; use 'tcp' or 'rdma'")
        engine = _transfer_engine_class()()
        if protocol == "rdma" and count_hcas(engine.get_local_topology(device_name or None)) == 0:
            raise RuntimeError(
                "protocol='rdma' was requested but Mooncake finds no RDMA device on this host; "
                "use protocol='tcp' or run where an HCA is visible (check device_name)"
            )
        if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) failed")
        self._engine, self._control, self.timeout_s, self._prefix = engine, control, timeout_s, key_prefix
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []
        self._peers: dict[int, dict] = {}
        self._written: dict[int, int] = {}
        self._buffer: torch.Tensor | None = None

    def register(self, tensor: torch.Tensor) -> None:
        """Register `tensor`'s memory with the engine (once per buffer; kept until close)."""
        ptr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self._engine.register_memory(ptr, n) != 0:
            raise RuntimeError(f"Mooncake could not register {n} bytes at {ptr:#x}")
        self._registered.append((ptr, n))

    def expose(self, receiver: int, staging: torch.Tensor) -> None:
        self.register(staging)
        desc = {"session": self.session_id, "addr": staging.data_ptr(), "nbytes": staging.numel()}
        self._control.post(f"{self._prefix}/receiver/{receiver}", json.dumps(desc).encode())

    def expect(self, receiver, messages, ranges, staging) -> PendingReceives:
        return _NothingToWaitFor()

    def send_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self.register(self._buffer)
        return self._buffer

    def _peer(self, receiver: int) -> dict:
        if receiver not in self._peers:
            raw = self._control.fetch(f"{self._prefix}/receiver/{receiver}", self.timeout_s)
            self._peers[receiver] = json.loads(raw)
        return self._peers[receiver]

    def _check_registered(self, ptr: int, n: int, what: str) -> None:
        if not any(base <= ptr and ptr + n <= base + size for base, size in self._registered):
            raise ValueError(
                f"{what}: local bytes [{ptr:#x}, +{n}) are not in a registered buffer; "
                "register it first (RDMA would reject it, Mooncake's TCP transport does not check)"
            )

    def write(self, message, ranges, payload, set_offset: int = 0) -> None:
        peer = self._peer(message.receiver)
        src, dst, lengths, at = [], [], [], 0
        for i in message.ranges:
            r = ranges[i]
            if set_offset + r.dst + r.nbytes > peer["nbytes"]:
                raise ValueError(f"range {r.index} ({r.name}) ends past receiver {message.receiver}'s staging buffer")
            self._check_registered(payload.data_ptr() + at, r.nbytes, f"range {r.index} ({r.name})")
            src.append(payload.data_ptr() + at)
            dst.append(peer["addr"] + set_offset + r.dst)
            lengths.append(r.nbytes)
            at += r.nbytes
        if self._engine.batch_transfer_sync_write(peer["session"], src, dst, lengths) != 0:
            raise PeerFailureError(
                f"Mooncake write of message {message.index} ({at} bytes) to receiver {message.receiver} "
                f"at {peer['session']} failed; the receiver is gone or its buffer is no longer registered"
            )
        self._written[message.receiver] = self._written.get(message.receiver, 0) + at

    @property
    def bytes_written(self) -> dict[int, int]:
        return dict(self._written)

    def close(self) -> None:
        for ptr, _ in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered = []


class _NothingToWaitFor:
    def wait(self, timeout_s: float) -> dict[int, int]:
        return {}
