"""Loopback ports for tests and benchmarks: below the kernel's ephemeral range, one slice per pytest-xdist
worker, handed out in turn across every process of that worker.

A port found by binding to port 0 comes from the ephemeral range, which the kernel also hands to every
outgoing connection (a gloo pair, a store client): between the moment a test picked it and the moment a
job listens on it, another connection of the other worker could take it (CI saw a trainer's rendezvous
fail with EADDRINUSE this way). Ports below that range are never taken by outgoing connections, each
worker draws from its own slice, and a counter in a locked file shared by the worker's processes (the
test, its spawned ranks, launched jobs) never gives one port twice in a row of 5,000.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile

LOWEST = 20000
"""The first port handed out; ports from here up to the ephemeral range are used."""


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> tuple[int, int, str]:
    """Return (first port, number of ports, name) of this process's slice: its xdist worker's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    top = max(_ephemeral_start(), LOWEST + 2000)
    span = (top - LOWEST) // count
    return LOWEST + (index % count) * span, span, worker or "main"


def _listenable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Return a loopback TCP port nobody listens on, not handed out by this function shortly before."""
    first, span, name = _slice()
    path = os.path.join(tempfile.gettempdir(), f"megatron-sync-test-ports-{os.getuid()}-{name}")
    with open(path, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # released when the file closes
        counter.seek(0)
        text = counter.read().strip()
        turn = int(text) if text.isdigit() else int.from_bytes(os.urandom(2), "little")
        for step in range(span):
            port = first + (turn + step) % span
            if _listenable(port):
                counter.seek(0)
                counter.truncate()
                counter.write(str((turn + step + 1) % span))
                return port
    raise RuntimeError(f"no free loopback port in {first}..{first + span - 1}")
