"""A launched command line whose output lines are recorded with the time they arrived, for tier-3 tests.

Tests wait on what the jobs print: `when(pattern)` waits for a line, `by=` a
deadline it must appear by (a bound that says "does not hang"; every bound is
scaled for a loaded machine, `tests/support/timing.py`), and `wait()` for the
exit. Nothing here sleeps to synchronise: waits poll the recorded lines
through the library's one wait helper.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from typing import Optional

from megatron_sync.core.wait import Deadline, WaitTimeout, clock, poll
from tests.support.timing import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Launched:
    """A command in its own session; `lines` holds (arrival time, text) of everything it printed."""

    def __init__(self, argv: list[str], *, env: Optional[dict] = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                                  "OMP_NUM_THREADS": "1", **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((clock().now(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def _first(self, pattern: str) -> Optional[float]:
        return next((at for at, line in list(self.lines) if re.search(pattern, line)), None)

    def when(self, pattern: str, within: float = 240.0, *, by: Optional[float] = None) -> float:
        """Return when the first line matching `pattern` arrived.

        Waits up to `scaled(within)`, or, with `by` (a time on the clock the lines are stamped with), until
        `by` (already scaled by the caller); a line that arrived later than `by` counts as not arriving.
        Raises AssertionError quoting the output when no such line came in time or the command ended first.
        """
        limit = Deadline(by) if by is not None else Deadline.after(scaled(within))
        ended = lambda: self.proc.poll() is not None and not self._reader.is_alive()  # noqa: E731
        try:
            at = poll(lambda: self._first(pattern) or (ended() and -1.0), within=limit, what=f"a line {pattern!r}",
                      max_pause_s=0.1)
        except WaitTimeout:
            at = None
        if at is None or at < 0 or at > limit.at:
            late = "" if at is None or at < 0 else f" (it came {at - limit.at:.1f}s after the bound)"
            raise AssertionError(f"no line matching {pattern!r} in time{late}:\n{self.output[-6000:]}")
        return at

    def wait(self, within: float = 60.0, *, by: Optional[float] = None) -> tuple[int, float]:
        """Return (exit code, when it exited), waiting up to `scaled(within)` or until `by` (scaled already);
        raises subprocess.TimeoutExpired when it is still running then."""
        limit = Deadline(by) if by is not None else Deadline.after(scaled(within))
        code = self.proc.wait(limit.remaining(floor=0.01))
        ended = clock().now()
        self._reader.join(scaled(10))
        return code, ended

    def kill(self) -> None:
        """SIGKILL the command and everything it started (torchrun puts workers in sessions of their own)."""
        from examples.demo import stop_job

        stop_job("test", self.proc, 0.0)


def within_bound(start: float, seconds: float) -> float:
    """Return the deadline `seconds` (scaled) after `start`: what `Launched.when(..., by=)` takes."""
    return start + scaled(seconds)
