"""One setting for every timeout a test sets: `scaled(seconds)`, and the `timeout` markers, grow with the load.

A bound in a test says "this does not hang", never "this is fast": it is
written for an idle 2-core machine and multiplied by `SCALE`, which is
`MEGATRON_SYNC_TEST_TIME_SCALE` when set, else the machine's load per core when
the run started (at least 1). No test asserts on elapsed wall time; a wait
that outlives its scaled bound fails the test as a timeout.
"""

from __future__ import annotations

import os

import pytest


def _scale_from_environment() -> float:
    configured = os.environ.get("MEGATRON_SYNC_TEST_TIME_SCALE")
    if configured:
        try:
            value = float(configured)
        except ValueError:
            raise ValueError(f"MEGATRON_SYNC_TEST_TIME_SCALE={configured!r} is not a number; set e.g. 2") from None
        if value < 1:
            raise ValueError(f"MEGATRON_SYNC_TEST_TIME_SCALE={value:g} would shorten bounds; use a value >= 1")
        return value
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, min(4.0, load / (os.cpu_count() or 1)))


SCALE = _scale_from_environment()
"""The factor every test bound is multiplied by (computed once per process; workers inherit the variable)."""
os.environ.setdefault("MEGATRON_SYNC_TEST_TIME_SCALE", f"{SCALE:g}")


def scaled(seconds: float) -> float:
    """Return the bound `seconds` (written for an idle machine) as this run allows it."""
    return seconds * SCALE


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Scale every test's pytest-timeout bound (its marker, else the ini default) by `SCALE`."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else default
        if seconds > 0 and SCALE != 1:
            item.add_marker(pytest.mark.timeout(scaled(seconds)), append=False)


def pytest_report_header(config) -> str:
    return f"test bounds scaled x{SCALE:g} (MEGATRON_SYNC_TEST_TIME_SCALE)"


class BoundExceeded(AssertionError):
    """A block a test bounds ("does not hang") ran past its scaled bound."""


class bounded:
    """`with bounded(seconds, "what"):` fails the test when the block runs past `scaled(seconds)`.

    For a bound inside a worker process or around a call that cannot be given a timeout of its own; a
    bound is a statement that something does not hang (or does not wait out a longer timeout), never a
    performance figure, and it grows with the load (`SCALE`)."""

    def __init__(self, seconds: float, what: str) -> None:
        from megatron_sync.core.wait import Deadline

        self.seconds, self.what, self._deadline_type = scaled(seconds), what, Deadline

    def __enter__(self) -> "bounded":
        self.deadline = self._deadline_type.after(self.seconds)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and self.deadline.expired():
            raise BoundExceeded(f"{self.what} took longer than its bound of {self.seconds:.3g}s "
                                f"(scaled x{SCALE:g} for load)")
