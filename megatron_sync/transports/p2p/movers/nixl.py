"""NIXL over UCX: one-sided writes from registered memory, host (DRAM) or GPU (VRAM) alike.

Each process runs one NIXL agent. A window is published as the agent's name and metadata (base64) with
the window's address, memory type and device; a writer adds the remote agent once, then each write is one
NIXL transfer of (address, bytes) descriptor lists that it polls (`check_xfer_state`) until done. From a
GPU arena into a GPU window UCX uses GPUDirect RDMA where the NIC offers it; on a CPU host the same calls
run over UCX's TCP transport (set `UCX_TLS=tcp` and `UCX_NET_DEVICES=lo` for loopback) or shared memory.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import threading
import uuid
from typing import Any, Iterator

import torch

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.core.wait import poll
from megatron_sync.transports.p2p.movers import Pending
from megatron_sync.transports.p2p.movers.one_sided import Board, OneSidedMover


NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
"""Where NIXL's Python API is looked for, in order: the `nixl` package (it loads the build of the CUDA it
detects), then a build's own module: nixl-cu13 (CUDA 13, what `make gpu-wheels` carries to a lent GPU
machine) and nixl-cu12 (CUDA 12, and this project's CPU requirements)."""


def nixl_api() -> Any:
    """Return NIXL's `_api` module (its agent, its config and the bindings) from the first of NIXL_MODULES
    that imports; an ImportError that names the fix when none does."""
    broken = []  # installed but failing to import: worth naming
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as e:
            if e.name not in (name, f"{name}._api"):
                broken.append(f"{name}: {e}")
        except ImportError as e:
            broken.append(f"{name}: {e}")
    why = "; ".join(broken) or f"none of {', '.join(NIXL_MODULES)} is installed"
    raise ImportError(f"the NIXL backend needs NIXL ({why}); install the build of this host's CUDA (nixl-cu12 or "
                      "nixl-cu13) and, on a host without RDMA, run UCX over TCP (UCX_TLS=tcp)")


_CONFIG_LOCK = threading.Lock()
WAKE_FIRST_S, WAKE_MAX_S = 0.0001, 0.001
"""How a write is waited for: checked after 0.1 ms, then at pauses doubling up to 1 ms. A write of a
256 MiB round takes about 6 ms through a 400 Gb/s NIC; pauses growing to 10 ms (the library's usual
poll) would end that wait up to 10 ms late at every hop of a chain, and on a rank without a progress
thread would leave the socket idle between checks."""


@contextlib.contextmanager
def _progress_wake(wake_ms: float) -> Iterator[None]:
    """While agents are made in this block, their progress thread sleeps on UCX's event descriptors and wakes
    at least every `wake_ms` (NIXL rounds up to whole ms); 0 leaves NIXL's own setting.

    NIXL's Python agent pins the C++ config's `pthrDelay` (the thread's poll() timeout) to 0, so the
    thread polls UCX without pause: a core per agent for as long as it lives, on a host that serves
    generation beside it. The wrapper builds that config from its bindings module while it makes the agent;
    for this block the module builds one whose delay is never set below `wake_ms`.
    """
    if wake_ms <= 0:
        yield
        return
    nixlBind = nixl_api().nixlBind
    base, delay_us = nixlBind.nixlAgentConfig, int(wake_ms * 1000)

    class Paced(base):
        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    with _CONFIG_LOCK:
        nixlBind.nixlAgentConfig = Paced
        try:
            yield
        finally:
            nixlBind.nixlAgentConfig = base


def _memory_type(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class _Transfer:
    """One NIXL write in flight; its handle is released once it ended."""

    def __init__(self, mover: "NixlMover", handle: Any, what: str) -> None:
        self._mover, self._handle, self._what, self._state = mover, handle, what, "PROC"

    def done(self) -> bool:
        if self._handle is not None:
            self._state = self._mover.agent.check_xfer_state(self._handle)
            if self._state in ("DONE", "ERR"):
                self._mover.agent.release_xfer_handle(self._handle)
                self._handle = None
        if self._state == "ERR":
            raise PeerFailureError(f"{self._what} failed in NIXL; the peer is gone or its window is not registered")
        return self._state == "DONE"

    def wait(self, timeout_s: float) -> None:
        # Checking also progresses the write where no progress thread runs (a trainer rank): pause little
        poll(self.done, within=timeout_s, what=self._what, first_pause_s=WAKE_FIRST_S, max_pause_s=WAKE_MAX_S,
             timeout=lambda waited: PeerFailureError(f"{self._what} did not complete within {waited:.3g}s"))


class NixlMover(OneSidedMover):
    """One-sided writes through a NIXL agent (see the module doc)."""

    name = "nixl"

    def __init__(self, board: Board, *, timeout_s: float = 300.0, prefix: str = "p2p/nixl",
                 device: torch.device = torch.device("cpu"), backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = True, wake_ms: float = 1.0) -> None:
        """`progress_thread`: NIXL's own thread progressing UCX. A rank that only writes (a trainer rank)
        needs none: its transfers progress while it polls them; a rank that is written to (an engine rank)
        keeps it, since over TCP a write lands only as the target's UCX worker progresses. `wake_ms`: that
        thread waits on UCX's event descriptors and wakes at least this often (`_progress_wake`); 0: it
        polls without pause, a core while it runs."""
        super().__init__(board, prefix=prefix, timeout_s=timeout_s)
        api = nixl_api()
        agent_cls, config_cls = api.nixl_agent, api.nixl_agent_config
        self.agent_name = f"megatron-sync-{uuid.uuid4().hex[:12]}"
        with _progress_wake(wake_ms if progress_thread else 0):
            self.agent = agent_cls(self.agent_name, config_cls(enable_prog_thread=progress_thread,
                                                               backends=list(backends)))
        self.device = device
        self._memory_type = _memory_type(device)
        self._remote: dict[str, str] = {}  # agent name -> the name NIXL gave it here

    def _register(self, memory: torch.Tensor) -> Any:
        kind, device = self._memory_type
        return self.agent.register_memory([(memory.data_ptr(), memory.numel(), device, "")], kind)

    def _unregister(self, handle: Any) -> None:
        self.agent.deregister_memory(handle)

    def _whoami(self, memory: torch.Tensor) -> dict:
        kind, device = self._memory_type
        return {"agent": self.agent_name, "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "mem": kind, "dev": device}

    def _remote_agent(self, peer: dict) -> str:
        if peer["agent"] not in self._remote:
            self._remote[peer["agent"]] = self.agent.add_remote_agent(base64.b64decode(peer["meta"]))
        return self._remote[peer["agent"]]

    def _start_write(self, peer, sources, destinations, lengths, memory, target) -> Pending:
        kind, device = self._memory_type
        local = self.agent.get_xfer_descs([(a, n, device) for a, n in zip(sources, lengths)], kind)
        remote = self.agent.get_xfer_descs([(a, n, peer["dev"]) for a, n in zip(destinations, lengths)], peer["mem"])
        what = f"NIXL write of {sum(lengths)} bytes to {target}"
        try:
            handle = self.agent.initialize_xfer("WRITE", local, remote, self._remote_agent(peer))
            state = self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 — NIXL raises its own types; re-raised as the peer failing
            raise PeerFailureError(f"{what} could not start: {type(e).__name__}: {e}") from e
        if state == "ERR":
            raise PeerFailureError(f"{what} could not start")
        return _Transfer(self, handle, what)

    def close(self) -> None:
        for name in self._remote.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 — the peer may be gone; nothing else to release for it
                pass
        self._remote = {}
        super().close()
