"""Run a function on several spawned CPU processes over gloo, for tests and demos.

``run_distributed`` never hangs: a remote exception stops every worker and is
re-raised in the caller with the remote traceback, and a run that outlives its
timeout is killed and reported as ``TimeoutError``.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = [
    "RemoteProcessError",
    "free_port",
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


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago (bound to port 0 to choose it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, env, timeout, results):
    import torch
    import torch.distributed as dist

    os.environ.update(env or {})
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # several ranks share few cores
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level). ``env`` is
    applied in each worker before the process group is created. The first remote
    exception raises ``RemoteProcessError`` (its message holds the remote traceback);
    exceeding ``timeout`` seconds raises ``TimeoutError``. Either way every worker is killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, env, timeout, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        _stop(procs)
        results.close()


def _collect(procs, results, world_size: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"run_distributed: ranks {missing} did not finish within {timeout}s")
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            _check_silent_deaths(procs, values)
            continue
        if not ok:
            raise RemoteProcessError(rank, payload)
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(world_size)]


def _check_silent_deaths(procs, values) -> None:
    # A worker killed by a signal (or os._exit) never reports; do not wait for the timeout.
    for rank, proc in enumerate(procs):
        if rank not in values and proc.exitcode is not None and proc.exitcode != 0:
            raise RemoteProcessError(rank, f"process exited with code {proc.exitcode} without reporting")


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def init_megatron(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> None:
    """Initialize Megatron's parallel_state, the CPU shims and all seeds inside a gloo worker."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from megatron_sync.testing.cpu_shim import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown_megatron() -> None:
    """Undo ``init_megatron`` so another layout can be initialized in the same process."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
