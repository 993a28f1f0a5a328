"""The suite's own plugins: tiers that tell the truth, per-test durations every run, timeouts scaled for load.

- Tiers (`tests/support/tiers.py`): a test that starts a process must carry the
  marker of its tier; collection fails for one whose code reaches a
  process-starting call without it, and the run fails it if it starts one anyway.
- Durations (`tests/support/durations.py`): every run writes each test's time
  and tier to `runs/test-durations/` and prints the slowest twenty and the tier
  totals beside the previous run's.
- Timeouts (`tests/support/timing.py`): every `timeout` marker is scaled by one
  factor for a loaded machine.
- Workers (`tests/support/workers.py`): under pytest-xdist, the tests of a file
  that share a module fixture run in one worker.
- Scratch (`tests/support/scratch.py`): the sockets vLLM's processes meet on
  go to a folder of the test process, removed at its end, not into /tmp.
"""

from __future__ import annotations

import os

# Every process of the suite runs eager (inherited by the launched jobs, the fork server's workers and the
# servers), as the vLLM test servers' --enforce-eager does for vLLM: torch.compile on CPU traces with dynamo and
# builds C++ with g++ in each process that reaches a compiled function. SGLang at TP>1 compiles its
# vocab-parallel embedding lookup at the first request (27 s of a TP=2 server's 55 s start on an idle machine);
# megatron-core compiles its jit_fuser functions (e.g. the MoE router's expert-bias update) in every trainer rank.
# Neither changes what a sync moves or what the tests compare; set TORCHDYNAMO_DISABLE=0 to run compiled.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# One OpenMP thread per process, as the launched jobs already had: two xdist workers with two threads each,
# beside the servers and ranks they start, oversubscribe two cores and their threads spin in each other's way
# (`make test-fast`: 183 s -> 132 s of pytest, 4 min 25 s -> 3 min 14 s of CPU). A test that needs more sets it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["tests.support.tiers", "tests.support.durations", "tests.support.timing", "tests.support.workers",
                  "tests.support.scratch"]
