"""Worker processes for tests, forked from one warm server that imported torch, megatron-core and transformers.

A spawned Python process spends about 7 CPU-seconds importing torch,
megatron-core and transformers before it does anything; the multi-process
tiers start several hundred of them. `context()` is a multiprocessing context
whose processes fork from a server process that imported those modules once
(multiprocessing's "forkserver", with the modules below preloaded), so a
worker starts in milliseconds. Each worker is still a fresh process: nothing a
test did in its own process (a registered transport, a patched module, an
initialised process group) reaches it, exactly as with "spawn"; the server
never runs a test's code. Workers get the calling process's environment as it
is when they start (`environ()`), not the server's.

`MEGATRON_SYNC_TEST_START=spawn` brings back plain spawned workers (to bisect a
failure that only a fresh interpreter shows).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Optional

PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "safetensors.torch",
    "yaml",
    "transformers",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.transformer",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "tests.support.models",
    "tests.support.cpu_shim",
]
"""What the server imports once (every worker inherits it; a module missing here is imported per worker)."""

_configured = False


def context() -> Any:
    """Return the multiprocessing context test workers start from (the warm forkserver by default)."""
    global _configured
    if os.environ.get("MEGATRON_SYNC_TEST_START") == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    if not _configured:
        ctx.set_forkserver_preload(PRELOAD)
        _configured = True
    return ctx


def environ() -> dict[str, str]:
    """Return the environment a worker started now must run with (this process's, as it is now)."""
    return dict(os.environ)


def adopt_environ(env: dict[str, str]) -> None:
    """In a worker: replace the inherited environment (the server's) with the caller's `env`."""
    os.environ.clear()
    os.environ.update(env)


def _in_environ(env: dict[str, str], target: Any, args: tuple, kwargs: dict) -> Any:
    adopt_environ(env)
    return target(*args, **kwargs)


def process(target: Any, args: tuple = (), kwargs: Optional[dict] = None, *, daemon: bool = True) -> Any:
    """Return an unstarted worker process (from `context()`) running `target(*args, **kwargs)` in the
    environment this process has now."""
    return context().Process(target=_in_environ, args=(environ(), target, args, kwargs or {}), daemon=daemon)


def die_with_parent() -> None:
    """`preexec_fn` for a server a test starts in a session of its own: SIGTERM reaches it when the process that
    started it ends, even by SIGKILL (a timed-out or killed pytest worker), so no server outlives its test run.
    Linux only (prctl PR_SET_PDEATHSIG, kept across the launcher's exec); elsewhere nothing."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass

