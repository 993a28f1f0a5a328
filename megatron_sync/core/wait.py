"""One way to wait: a deadline on a clock that tests can replace, and a poll that backs off.

Every wait of the library that is not a blocking call with its own timeout goes
through `poll` (or `Deadline` where a caller splits one bound over several
blocking calls), so a test that swaps the clock (`using_clock`) controls every
wait at once: a `ManualClock` makes a poll that would take minutes end at
once, without sleeping, and shows exactly when it gave up.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sized, TypeVar, Union

T = TypeVar("T")

FIRST_PAUSE_S = 0.005
"""The first pause of a poll; it doubles up to the poll's `max_pause_s`."""
MAX_PAUSE_S = 0.05
"""The longest pause of a poll by default: the latency a poll adds to whatever it waits for, at most."""


class Clock(Protocol):
    """Where waits read the time and pause."""

    def now(self) -> float:
        """Return seconds on a monotonic scale."""

    def sleep(self, seconds: float) -> None:
        """Pause for `seconds`."""

    def wait_event(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds` for `event`; return whether it is set."""


class SystemClock:
    """The real clock: `time.monotonic` and real sleeps."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    def wait_event(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(seconds, 0.0))


REAL_MOMENT_S = 0.001
"""The real time a `ManualClock` pause takes, whatever it stands for."""


class ManualClock:
    """A clock for tests: time moves only when something sleeps on it (or `advance` is called).

    A pause of any length takes `REAL_MOMENT_S` of real time, so a poll that would wait minutes ends in
    milliseconds, and what it measured is exact (the pauses it made), not the machine's speed."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.sleeps: list[float] = []

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the time forward by `seconds`."""
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        time.sleep(REAL_MOMENT_S)  # other threads run between two looks of a poll, as they would in real time
        self.advance(max(seconds, 0.0))

    def wait_event(self, event: threading.Event, seconds: float) -> bool:
        # a moment of real time, so that the thread that sets `event` (or does what a poll waits for) runs
        if not event.wait(REAL_MOMENT_S):
            self.sleep(seconds)
        return event.is_set()


_clock: Clock = SystemClock()


def clock() -> Clock:
    """Return the clock every wait of this process uses."""
    return _clock


@contextlib.contextmanager
def using_clock(replacement: Clock) -> Iterator[Clock]:
    """Make every wait of this process use `replacement` inside the block (tests)."""
    global _clock
    previous, _clock = _clock, replacement
    try:
        yield replacement
    finally:
        _clock = previous


class WaitTimeout(TimeoutError):
    """A poll gave up: what it waited for did not happen within its bound."""


@dataclass(frozen=True)
class Deadline:
    """A moment on the clock; `remaining()` splits one bound over several blocking calls."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        """Return the deadline `seconds` from now."""
        return cls(clock().now() + seconds)

    def remaining(self, floor: float = 0.0) -> float:
        """Return the seconds left (never below `floor`: a blocking call given 0 may wait forever)."""
        return max(self.at - clock().now(), floor)

    def expired(self) -> bool:
        """Return True once the deadline has passed."""
        return clock().now() >= self.at


Bound = Union[float, Deadline]


def deadline_of(bound: Bound) -> Deadline:
    """Return `bound` as a Deadline (seconds from now, or itself)."""
    return bound if isinstance(bound, Deadline) else Deadline.after(bound)


def poll(ready: Callable[[], Optional[T]], *, within: Bound, what: str,
         max_pause_s: float = MAX_PAUSE_S, wake: Optional[threading.Event] = None,
         timeout: Optional[Callable[[float], BaseException]] = None, first_pause_s: float = FIRST_PAUSE_S) -> T:
    """Call `ready()` until it returns a result; return that. None, False and an empty container
    ({}, [], "") are "not yet"; anything else, 0 included, is a result.

    Pauses start at `first_pause_s` (a wait for something that takes ms asks for less than the default
    `FIRST_PAUSE_S`, since it may return up to a pause late) and double up to `max_pause_s`; with `wake`
    (an event whoever makes `ready` true sets) a pause ends as soon as it is
    set. After `within` (seconds, or a Deadline) `ready` is called one last
    time, then the poll raises `timeout(seconds waited)` when given, else
    `WaitTimeout` naming `what` ("the trainer's report of version 3").
    """
    limit, started = deadline_of(within), clock().now()
    pause = min(first_pause_s, max_pause_s) if wake is None else max_pause_s
    while True:
        value = ready()
        if _is_result(value):
            return value
        if limit.expired():
            waited = clock().now() - started
            raise timeout(waited) if timeout is not None else WaitTimeout(
                f"{what} did not happen within {waited:.3g}s")
        if wake is None:
            clock().sleep(min(pause, limit.remaining()))
        else:
            clock().wait_event(wake, min(pause, limit.remaining()))
        pause = min(pause * 2, max_pause_s)


def _is_result(value: Any) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, Sized) and len(value) == 0)


def every(seconds: float, stop: threading.Event) -> Iterator[None]:
    """Yield every `seconds` until `stop` is set (a watcher thread's loop)."""
    while not clock().wait_event(stop, seconds):
        yield
