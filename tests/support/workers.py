"""`make test` runs the suite in two pytest-xdist workers; this keeps what must stay together together.

A test that uses a fixture shared beyond itself (module, package or session
scope: a vLLM server, a built model, process groups) is put in its file's
`xdist_group`, so `--dist loadgroup` runs the whole file in one worker and the
fixture is made once, as in a serial run. Every other test goes to whichever
worker is free. The grouped files are collected first: each is one long unit of
work, and one scheduled last would run alone while the other worker idles; then the
other process-starting tiers, slowest first, and the pure tests last, the modules whose tests plan models
at full size (15-35 s each) before the rest, for the same reason.

Without xdist (`-p no:xdist`, or a plain `pytest` on one file) nothing changes.
"""

from __future__ import annotations

import pytest

SHARED_SCOPES = ("module", "package", "session")


def _shares_a_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in SHARED_SCOPES and defs[-1].baseid != ""
               for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    # First: xdist's own hook (in each worker) reads the xdist_group markers to name the groups, so they must
    # be there before it runs (run after it, they were never seen and a module's servers started twice).
    if not config.pluginmanager.hasplugin("xdist"):
        return
    grouped = []
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
            grouped.append(item)
    together = set(grouped)
    # then the slow tiers before the quick ones, so the many short pure tests fill the end, not a 30 s launch
    rest = sorted((item for item in items if item not in together), key=_tier_order)
    items[:] = grouped + rest


def _tier_order(item) -> tuple[int, int]:
    marks = {mark.name for mark in item.iter_markers()}
    tier = next((i for i, tier in enumerate(SLOW_FIRST) if tier in marks), len(SLOW_FIRST))
    return tier, 0 if item.nodeid.split("::")[0] in LONG_PURE else 1


SLOW_FIRST = ("vllm", "sglang", "e2e", "multiproc")
"""Tiers whose tests start processes, slowest first; unmarked (pure) tests come after them."""
LONG_PURE = ("tests/test_scale_published.py", "tests/test_scale_p2p.py")
"""Pure modules with tests of 15-35 s (every published row, Kimi-K2, planned at full size): first among the
pure tests. Last, one of them ran alone for up to half a minute at the end of the suite."""
