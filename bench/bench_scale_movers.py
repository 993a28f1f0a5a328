"""This machine's cost of moving bytes between two processes with each P2P backend, for the scale model's
`local` profile (called by bench_scale_rates.py; the rates it returns are stored in rates_local.json).

Per backend, two processes on loopback (TCP): rank 1 writes `nbytes` from a registered buffer into rank
0's registered buffer `reps` times; measured per byte are the writer's CPU (`send_<b>_byte`), the
receiver's CPU while the bytes land (`recv_<b>_byte`) and the wall time of the writes (`wall_<b>_byte`),
and the wall time of one tiny write (`op_<b>_s`). The libraries are driven through their own Python APIs
(what megatron-sync's movers call), so nothing here depends on the transport's code:

- torch: gloo send / recv on the process group (two-sided);
- mooncake: Mooncake Transfer Engine over TCP (`P2PHANDSHAKE`, one-sided `batch_transfer_sync_write`);
- nixl: a NIXL agent over UCX's TCP transport on loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`), WRITE.

A backend whose library is missing is skipped (its rates stay unmeasured, and the model says so).
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

BACKENDS = ("torch", "mooncake", "nixl")
NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _exchange(value):
    out = [None, None]
    dist.all_gather_object(out, value)
    return out


class _Torch:
    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def write(self, rank: int, nbytes: int) -> None:
        if rank == 1:
            dist.send(self.buf[:nbytes], 0)
        else:
            dist.recv(self.buf[:nbytes], 1)

    def close(self) -> None:
        pass


class _Mooncake:
    def __init__(self, buf: torch.Tensor):
        from mooncake.engine import TransferEngine

        self.engine, self.buf = TransferEngine(), buf
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) failed")
        if self.engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        me = (f"127.0.0.1:{self.engine.get_rpc_port()}", buf.data_ptr())
        self.peer = _exchange(me)[0]

    def write(self, rank: int, nbytes: int) -> None:
        if rank == 1:
            session, ptr = self.peer
            if self.engine.batch_transfer_sync_write(session, [self.buf.data_ptr()], [ptr], [nbytes]) != 0:
                raise RuntimeError(f"Mooncake write of {nbytes} bytes to {session} failed")

    def close(self) -> None:
        self.engine.unregister_memory(self.buf.data_ptr())


class _Nixl:
    def __init__(self, buf: torch.Tensor):
        from megatron_sync.transports.p2p.movers.nixl import nixl_api

        api = nixl_api()
        self.buf = buf
        self.agent = api.nixl_agent(f"scale-rates-{dist.get_rank()}", api.nixl_agent_config(backends=["UCX"]))
        self.reg = self.agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
        peers = _exchange((self.agent.get_agent_metadata(), buf.data_ptr()))
        self.remote = self.agent.add_remote_agent(peers[0][0]) if dist.get_rank() == 1 else None
        self.peer_ptr = peers[0][1]

    def write(self, rank: int, nbytes: int) -> None:
        if rank != 1:
            return
        local = self.agent.get_xfer_descs([(self.buf.data_ptr(), nbytes, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.peer_ptr, nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.remote)
        state = self.agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL write of {nbytes} bytes failed")

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


MOVERS = {"torch": _Torch, "mooncake": _Mooncake, "nixl": _Nixl}


def loopback(rank: int, world: int, cfg: dict) -> dict:
    """Run in two gloo ranks: {CPU seconds of this rank's writes (or landings), their wall seconds, one tiny
    write's wall seconds} for backend cfg["backend"], `cfg["nbytes"]` written `cfg["reps"]` times."""
    nbytes, reps = cfg["nbytes"], cfg["reps"]
    mover = MOVERS[cfg["backend"]](torch.empty(nbytes, dtype=torch.uint8).fill_(rank))
    try:
        mover.write(rank, nbytes)  # warm-up
        dist.barrier()
        cpu, wall = _cpu(), time.perf_counter()
        for _ in range(reps):
            mover.write(rank, nbytes)
        dist.barrier()  # the receiver's copy is complete once the writer's writes returned (sync writes)
        cpu, wall = _cpu() - cpu, time.perf_counter() - wall
        tiny = time.perf_counter()
        for _ in range(20):
            mover.write(rank, 64)
        dist.barrier()
        tiny = (time.perf_counter() - tiny) / 20
        return {"cpu": cpu, "wall": wall, "tiny": tiny}
    finally:
        mover.close()


def measure(backend: str, nbytes: int, reps: int, run_distributed) -> dict[str, float] | None:
    """Return the backend's rates (see the module doc), or None when its library is not installed."""
    try:
        if backend == "nixl":
            from megatron_sync.transports.p2p.movers.nixl import nixl_api
            nixl_api()
        else:
            __import__({"torch": "torch", "mooncake": "mooncake.engine"}[backend])
    except ImportError:
        return None
    env = NIXL_ENV if backend == "nixl" else None
    receiver, writer = run_distributed(loopback, 2, {"backend": backend, "nbytes": nbytes, "reps": reps},
                                       timeout=600, env=env)
    total = nbytes * reps
    return {f"send_{backend}_byte": writer["cpu"] / total, f"recv_{backend}_byte": receiver["cpu"] / total,
            f"wall_{backend}_byte": max(writer["wall"], receiver["wall"]) / total,
            f"op_{backend}_s": max(writer["tiny"], receiver["tiny"])}
