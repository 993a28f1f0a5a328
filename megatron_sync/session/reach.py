"""Reaching a rendezvous: probe its port, connect a bounded client, present a ticket, report a failure.

What a joiner does before it holds a `SyncSession` (`session.py`), and what a
rank that failed while starting does instead of joining. Every wait here is
bounded, and each way a port can be wrong (nothing listens, something that
never answers holds it, another kind of store answers) is named with its fix.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import struct
from typing import Any, Optional

import torch.distributed as dist

from megatron_sync.core.errors import RendezvousError, StoreSilentError
from megatron_sync.core.wait import clock, poll
from megatron_sync.session.rendezvous import Decision, Identity, host_unproven, signed
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.store import BoundedStore

log = logging.getLogger("megatron_sync")

PROBE_S = 10.0  # how long a connected port may stay silent before it counts as "held by something else"
REPORT_WAIT_S = 30.0  # how long a rank that failed while starting waits for the host to listen, to tell it
NOTICE_AFTER_S = 2.0  # how long nothing may listen before a joiner says so (it keeps waiting up to its bound)
STORE_ERRORS = (RuntimeError, dist.DistStoreError, dist.DistNetworkError)


def report_failure(address: str, port: int, identity: Identity, reason: str, *, timeout_s: float,
                   secret: Optional[SessionSecret] = None) -> bool:
    """Post that `identity` failed while starting (before it could join); return True if the host got it.

    Waits at most `REPORT_WAIT_S` (not `timeout_s`) for a host to listen: a trainer launched alongside
    is told, one that died (or starts much later) is not waited for; the failing rank says its error
    itself first. With `secret` the report carries its proof (a host with a secret ignores one without)."""
    store = None
    try:
        store = connect(address, port, timeout_s=timeout_s, wait_s=min(REPORT_WAIT_S, timeout_s),
                        waiting_for="to report this rank's start-up failure")
        where = f"{address}:{port}"
        host = Identity.from_json(read(store, "rdzv/session", where))
        present(store, dataclasses.replace(identity, failure=reason), where, timeout_s, secret=secret, host=host)
        return True
    except RendezvousError as e:
        log.warning("could not report this rank's start-up failure to the rendezvous: %s", e)
        return False
    finally:
        if store is not None:
            store.close()


def connect(address: str, port: int, *, timeout_s: float, probe_s: float = PROBE_S,
            wait_s: Optional[float] = None, waiting_for: str = "to join the trainer") -> BoundedStore:
    """Return a (bounded) client of the rendezvous store at address:port, waiting up to `wait_s` (default
    `timeout_s`) for its host to listen; once nothing has listened for `NOTICE_AFTER_S` it logs so (naming
    the address and the fix) and keeps waiting.

    Raises RendezvousError naming what is wrong: nothing listens there (the
    trainer did not start, or a wrong address), the port is held by a program
    that never answers, or it answers but is not a megatron-sync rendezvous.
    """
    where = f"{address}:{port}"
    wait_s = timeout_s if wait_s is None else wait_s
    started, told = clock().now(), []

    def listening() -> bool:
        problem = _probe(address, port, min(probe_s, timeout_s))
        if problem not in (None, "refused"):
            raise _unreachable(where, problem, min(probe_s, timeout_s), wait_s)
        if problem == "refused" and not told and clock().now() - started >= NOTICE_AFTER_S:
            told.append(True)
            log.warning("no trainer's rendezvous answers at %s (connection refused: nothing listens there); waiting "
                        "up to %gs %s. The trainer's first stage hosts it: start the trainer, or check "
                        "weight_sync.master_address / master_port", where, wait_s, waiting_for)
        return problem is None

    poll(listening, within=wait_s, what=f"a rendezvous listening at {where}", max_pause_s=0.2,
         timeout=lambda _: _unreachable(where, "refused", min(probe_s, timeout_s), wait_s))
    try:
        store = BoundedStore(dist.TCPStore(address, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                                           wait_for_workers=False), where=where, timeout_s=timeout_s)
    except STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous at {where}: connecting failed: {e}") from e
    poll(lambda: read(store, "rdzv/session", where) is not None, within=min(probe_s, timeout_s),
         what="the rendezvous's session marker", timeout=lambda _: RendezvousError(
             f"the store at {where} is not a megatron-sync rendezvous (no session was posted there): is "
             "weight_sync.master_port also some job's MASTER_PORT or another store's port? Choose a free one"))
    return store


def _unreachable(where: str, problem: str, probe_s: float, wait_s: float) -> RendezvousError:
    words = _PROBLEMS.get(problem, "{problem}").format(problem=problem, probe=probe_s, timeout=wait_s)
    return RendezvousError(f"the rendezvous at {where}: {words}")


_PROBLEMS = {
    "refused": "nothing answered for {timeout:g}s (connection refused: nothing listens there). The trainer's "
               "first stage hosts the rendezvous: start the trainer, or check weight_sync.master_address / "
               "master_port",
    "silent": "the port accepted a connection but nothing answered within {probe:g}s: it is held by a program "
              "that is not a megatron-sync rendezvous. Choose another weight_sync.master_port",
}

# What a TCPStore client says first: VALIDATE with torch's magic number, then PING with a nonce the server
# echoes. Only the silence matters here: any reply (even one a future torch words differently) goes on to
# the real client, whose own errors are reported.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


def _probe(address: str, port: int, probe_s: float) -> Optional[str]:
    """Return None if something answers at address:port, "refused", "silent", or the socket error."""
    try:
        sock = socket.create_connection((address, port), timeout=probe_s)
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "silent"
    except OSError as e:
        return f"cannot connect: {e.strerror or e}"
    with sock:
        try:
            sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, os.getpid() & 0xFFFFFFFF))
            sock.settimeout(probe_s)
            sock.recv(4)  # an answer, or b"" when the peer closes: either way it is not silent
        except socket.timeout:
            return "silent"
        except OSError:
            pass
    return None


def present(store: Any, identity: Identity, where: str, timeout_s: float, *,
            secret: Optional[SessionSecret] = None, host: Optional[Identity] = None) -> Decision:
    """Post `identity` (signed with `secret` for `host`) as the next ticket and return the host's answer
    (waiting up to `timeout_s`). A host that does not prove `secret` refuses the ticket by name (and logs
    it); one that accepts it anyway is not joined."""
    unproven = None
    if host is not None:
        unproven = host_unproven(host, secret, where)
        identity = signed(identity, secret, host)
    try:
        ticket = store.add("rdzv/tickets", 1)
        store.set(f"rdzv/ticket/{ticket}", identity.to_json())
    except STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous at {where} went away while {identity.describe()} joined: {e}") from e
    raw = poll(lambda: read(store, f"rdzv/answer/{ticket}", where), within=timeout_s,
               what=f"the answer to {identity.describe()}", timeout=lambda _: RendezvousError(
                   f"the rendezvous at {where} did not answer {identity.describe()} within {timeout_s:g}s (its "
                   "host is alive but busy or stuck)"))
    add(store, "rdzv/acks", 1)  # the host may leave once every answer was read
    decision = Decision.from_json(raw)
    if decision.accepted and unproven is not None:
        raise RendezvousError(f"{identity.describe()} does not join: {unproven}")
    return decision


def read(store: Any, key: str, where: str) -> Optional[bytes]:
    """Return the value under `key`, or None if not posted yet; RendezvousError if the host is gone."""
    try:
        return store.get(key) if store.check([key]) else None
    except StoreSilentError as e:
        raise RendezvousError(f"the rendezvous host at {where} stopped answering: {e}") from e
    except STORE_ERRORS as e:
        raise RendezvousError(f"the rendezvous host at {where} went away (the trainer exited or was killed): "
                              f"{e}") from e


def add(store: Any, key: str, amount: int) -> float:
    """Return the counter under `key` after adding `amount`; infinity once the store is gone (nobody is
    left to wait for)."""
    try:
        return store.add(key, amount)
    except STORE_ERRORS:
        return float("inf")


def hosting_problem(address: str, port: int, error: BaseException) -> str:
    """Return why hosting the rendezvous at address:port failed, and the fix."""
    text = str(error)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"cannot host the rendezvous at {address}:{port}: the port is already in use (another trainer's "
                "rendezvous, or another program, holds it). Choose a free weight_sync.master_port, or stop the "
                "other job")
    return (f"cannot host the rendezvous at {address}:{port}: {text.splitlines()[0] if text else error!r}. "
            "weight_sync.master_address must be an address of the host of the trainer's first stage")
