"""Test-only vLLM plugin: readers of vLLM's shared-memory message queues poll every 0.5 ms instead of spinning.

For 1 s after each message, a reader of vLLM's shared-memory queue (each TP worker, reading the engine
core's calls; the engine core, reading the workers' replies) loops on the buffer calling sched_yield
(`shm_broadcast.SpinCondition.wait`). During a sync the calls come less than a second apart, so on this
2-core machine the two workers of a TP=2 test server spun most of the time: 71 CPU-s each of the 224 that
tests/test_vllm_sync.py took, taken from the trainer ranks they wait for. With
MEGATRON_SYNC_TEST_PACED_SPIN=1 (VLLMServer sets it) the loop sleeps 0.5 ms where it yielded. It checks the
same buffer at the same points, so what a reader reads, and when it may, is unchanged; a message waits up
to 0.5 ms longer. (Skipping the loop, so that readers sleep on vLLM's notify socket at once, stalled
generation on a TP=2 server here.)
"""

from __future__ import annotations

import os
import time

PAUSE_S = 0.0005


def _paced_yield() -> None:
    time.sleep(PAUSE_S)


def register() -> None:
    """Replace the queue module's sched_yield in this process, when configured."""
    if os.environ.get("MEGATRON_SYNC_TEST_PACED_SPIN") != "1":
        return
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.sched_yield = _paced_yield
