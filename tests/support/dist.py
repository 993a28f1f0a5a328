"""Run a function on several spawned CPU processes over gloo, for tests and demos.

``run_distributed`` never hangs: a remote exception stops every worker and is
re-raised in the caller with the remote traceback, and a run that outlives its
timeout is killed and reported as ``TimeoutError``.
"""

from __future__ import annotations

import datetime
import os
import io
import queue
import time
import traceback
from typing import Any, Callable

from examples.tiny.megatron import init_megatron, teardown_megatron  # noqa: F401 — re-exported
from tests.support.ports import free_port
from tests.support.procs import adopt_environ, context as procs_context, environ
from tests.support.timing import scaled

__all__ = [
    "RemoteProcessError",
    "free_port",
    "run_ranks",
    "run_distributed",
    "init_megatron",
    "teardown_megatron",
]


class RemoteProcessError(RuntimeError):
    """An exception raised in a worker of ``run_distributed``; the message holds its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _worker(fn, rank, world_size, port, args, env, timeout, init_group, results):
    import torch
    import torch.distributed as dist

    adopt_environ(env)  # the caller's environment with the run's own variables (not the fork server's)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # several ranks share few cores
    try:
        if init_group:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        value = fn(rank, world_size, *args) if init_group else fn(rank, *args)
        results.put((rank, "ok", _dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dumps(value: Any) -> bytes:
    """Serialize a rank's result; torch.save's format, since plain pickle cannot load float8 tensors."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    init_group: bool = True,
    fail_fast: bool = False,
) -> dict[int, tuple[str, Any]]:
    """Run ``fn`` on ``world_size`` spawned processes; return ``{rank: (status, value)}`` once all ended.

    With ``init_group`` each worker joins a gloo default group and calls
    ``fn(rank, world_size, *args)``; without it, ``fn(rank, *args)`` (for code
    that builds its own groups). ``status`` is "ok" (``value`` is the result),
    the exception class name (``value`` holds the message and remote
    traceback), "exited" (``value`` is the exit code of a process that died
    without reporting) or "hung" (still running after ``timeout``; killed).
    With ``fail_fast`` the run ends as soon as one rank failed (the others are
    reported "hung"). Every worker is gone when this returns.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = scaled(timeout)  # a bound for an idle machine, grown with the load (tests/support/timing.py)
    ctx = procs_context()
    results = ctx.Queue()
    port = free_port()
    env = {**environ(), **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, env, timeout, init_group, results),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, timeout, fail_fast)
    finally:
        _stop(procs)
        results.close()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level). ``env`` is
    applied in each worker before the process group is created. A remote exception
    or a silent death raises ``RemoteProcessError`` (its message holds the remote
    traceback); exceeding ``timeout`` seconds (scaled for load) raises ``TimeoutError``. Either way
    every worker is killed.
    """
    outcomes = run_ranks(fn, world_size, *args, timeout=timeout, env=env, fail_fast=True)
    hung = sorted(r for r, (status, _) in outcomes.items() if status == "hung")
    # In arrival order: the first rank to fail is the root cause; its peers fail because of it.
    failed = [(r, s, v) for r, (s, v) in outcomes.items() if s not in ("ok", "hung")]
    if failed:
        rank, status, value = failed[0]
        raise RemoteProcessError(rank, f"process exited with code {value} without reporting"
                                 if status == "exited" else value)
    if hung:
        raise TimeoutError(f"run_distributed: ranks {hung} did not finish within {timeout}s")
    return [outcomes[r][1] for r in range(world_size)]


def _collect(procs, results, timeout: float, fail_fast: bool) -> dict[int, tuple[str, Any]]:
    """Gather every rank's outcome until all reported, all died, the deadline, or (fail_fast) a failure."""
    deadline = time.monotonic() + timeout
    out: dict[int, tuple[str, Any]] = {}
    while len(out) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            out[rank] = (status, _loads(value) if status == "ok" else value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
        died = any(r not in out and p.exitcode not in (None, 0) for r, p in enumerate(procs))
        if fail_fast and (died or any(status != "ok" for status, _ in out.values())):
            deadline = min(deadline, time.monotonic() + 0.5)  # a last look for the report in flight
    for rank, proc in enumerate(procs):
        if rank in out:
            continue
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            out[rank] = ("hung", None)
        else:
            out[rank] = ("exited", proc.exitcode)
    return out


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


