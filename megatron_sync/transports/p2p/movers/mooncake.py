"""Mooncake Transfer Engine: one-sided writes into a peer's registered memory (RDMA, or TCP on CPU).

The engine meets its peers by P2P handshake (no metadata server): a window is published as the engine's
session id (host:port) with its address. Writes are Mooncake's synchronous batch write run on this mover's
own thread, one batch after another in posting order, so the caller goes on staging the next pieces while
they travel. With protocol "rdma" and no RDMA device this refuses to start (Mooncake would fall back to TCP
silently).
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.transports.p2p.movers import Pending
from megatron_sync.transports.p2p.movers.one_sided import Board, OneSidedMover


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
    return len({hca for lists in topology.values() for hcas in lists for hca in hcas})


class _Write:
    """A batch write running on the mover's thread."""

    def __init__(self, future: Future, what: str) -> None:
        self._future, self._what = future, what

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float) -> None:
        try:
            status = self._future.result(timeout=timeout_s)
        except TimeoutError as e:
            raise PeerFailureError(f"{self._what} did not complete within {timeout_s:g}s") from e
        if status != 0:
            raise PeerFailureError(f"{self._what} failed (Mooncake status {status}); the peer is gone or its "
                                   "window is no longer registered")


class MooncakeMover(OneSidedMover):
    """One-sided writes through Mooncake's Transfer Engine (see the module doc)."""

    name = "mooncake"

    def __init__(self, board: Board, *, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 timeout_s: float = 300.0, prefix: str = "p2p/mooncake", device: torch.device = torch.device("cpu")):
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"p2p_protocol={protocol!r}; use 'tcp' or 'rdma'")
        super().__init__(board, prefix=prefix, timeout_s=timeout_s)
        engine = _transfer_engine_class()()
        if protocol == "rdma" and count_hcas(engine.get_local_topology(device_name or None)) == 0:
            raise RuntimeError("p2p_protocol 'rdma' was requested but Mooncake finds no RDMA device on this host; "
                               "use p2p_protocol 'tcp' or run where an HCA is visible (check p2p_device_name)")
        if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) failed")
        self._engine, self.device = engine, device
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="megatron-sync-mooncake")

    def _register(self, memory: torch.Tensor) -> Any:
        address, nbytes = memory.data_ptr(), memory.numel()
        if self._engine.register_memory(address, nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes at {address:#x}")
        return address

    def _unregister(self, handle: Any) -> None:
        self._engine.unregister_memory(handle)

    def _whoami(self, memory: torch.Tensor) -> dict:
        return {"session": self.session_id}

    def _start_write(self, peer, sources, destinations, lengths, memory, target) -> Pending:
        def write() -> int:
            return self._engine.batch_transfer_sync_write(peer["session"], sources, destinations, lengths)

        return _Write(self._thread.submit(write), f"Mooncake write of {sum(lengths)} bytes to {target} "
                                                  f"at {peer['session']}")

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        super().close()
