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

pytest_plugins = ["tests.support.tiers", "tests.support.durations", "tests.support.timing", "tests.support.workers",
                  "tests.support.scratch"]
