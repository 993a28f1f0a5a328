"""Every run records each test's duration and tier; the summary compares them with the previous run's.

Written to `runs/test-durations/` (ignored by git): `latest.json` for this
run, the one before it kept as `previous.json`, and a dated copy; while a run
goes on, each finished test is appended to `partial-<pid>.jsonl` (a run that is
killed still leaves what it measured). The
terminal summary lists the slowest twenty tests and the wall seconds per tier,
each beside the previous run's figure. `python -m tests.support.durations
[FILE]` prints the same tables as markdown (what the README's tests section
quotes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any, Optional

from tests.support.tiers import TIERS, tier_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(ROOT, "runs", "test-durations")
SLOWEST = 20

_started = time.time()
_tests: dict[str, dict[str, Any]] = {}
_worker = []  # [True] in a pytest-xdist worker: the controller records what its workers report


def pytest_configure(config) -> None:
    if getattr(config, "workerinput", None) is not None:
        _worker.append(True)


def pytest_runtest_logreport(report) -> None:
    if _worker:
        return
    entry = _tests.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed", "tier": None})
    if entry["tier"] is None:  # collected by a worker: the report carries the test's marker names
        entry["tier"] = next((t for t in TIERS if t in report.keywords), "pure")
    entry["seconds"] += report.duration
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if report.when == "teardown":  # a run that is killed still leaves what it measured
        os.makedirs(FOLDER, exist_ok=True)
        with open(_partial_path(), "a") as f:
            f.write(json.dumps({"test": report.nodeid, **entry}) + "\n")


def _partial_path() -> str:
    """This run's own file of finished tests (two runs in one checkout never share one)."""
    return os.path.join(FOLDER, f"partial-{os.getpid()}.jsonl")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        _tests.setdefault(item.nodeid, {"seconds": 0.0, "outcome": "passed", "tier": None})["tier"] = tier_of(item)


def tier_totals(tests: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Return {tier: {"tests": count, "seconds": sum}} over the tests that ran (skipped ones count, 0 s)."""
    totals: dict[str, dict[str, float]] = {}
    for entry in tests.values():
        row = totals.setdefault(entry["tier"] or "unknown", {"tests": 0, "seconds": 0.0})
        row["tests"] += 1
        row["seconds"] += entry["seconds"]
    return dict(sorted(totals.items()))


def pytest_sessionfinish(session, exitstatus) -> None:
    ran = {k: v for k, v in _tests.items() if v["seconds"] > 0 or v["outcome"] != "passed"}
    if not ran or _worker:
        return
    record = {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(_started)),
              "wall_seconds": time.time() - _started, "exit_status": int(exitstatus),
              "load_average": list(os.getloadavg()), "args": sys.argv[1:], "tests": ran}
    os.makedirs(FOLDER, exist_ok=True)
    latest = os.path.join(FOLDER, "latest.json")
    if os.path.exists(latest):
        shutil.copyfile(latest, os.path.join(FOLDER, "previous.json"))
    with open(latest, "w") as f:
        json.dump(record, f, indent=1)
    shutil.copyfile(latest, os.path.join(FOLDER, time.strftime("%Y%m%d-%H%M%S", time.localtime(_started)) + ".json"))
    try:
        os.remove(_partial_path())  # the whole record is written
    except OSError:
        pass
    session.config._durations_record = record


def _load(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tables(record: dict[str, Any], previous: Optional[dict[str, Any]] = None, markdown: bool = False) -> list[str]:
    """Return the lines of the slowest-tests table and the tier table of `record`, beside `previous`."""
    before = (previous or {}).get("tests", {})
    tests = record["tests"]
    slow = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:SLOWEST]
    lines = ["| seconds | before | tier | test |", "|---:|---:|---|---|"] if markdown else [
        f"slowest {SLOWEST} tests (seconds, previous run):"]
    for nodeid, entry in slow:
        was = before.get(nodeid, {}).get("seconds")
        was_text = f"{was:.1f}" if was is not None else "-"
        lines.append(f"| {entry['seconds']:.1f} | {was_text} | {entry['tier']} | `{nodeid}` |" if markdown
                     else f"  {entry['seconds']:7.1f}  {was_text:>7}  {entry['tier']:<9} {nodeid}")
    totals, old = tier_totals(tests), tier_totals(before) if before else {}
    lines += ["", "| tier | tests | seconds | before |", "|---|---:|---:|---:|"] if markdown else [
        "seconds per tier (previous run):"]
    for tier, row in totals.items():
        was = old.get(tier, {}).get("seconds")
        was_text = f"{was:.0f}" if was is not None else "-"
        lines.append(f"| {tier} | {row['tests']:.0f} | {row['seconds']:.0f} | {was_text} |" if markdown
                     else f"  {tier:<9} {row['tests']:5.0f} tests {row['seconds']:8.0f} s  (before: {was_text})")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    record = getattr(config, "_durations_record", None)
    if record is None:
        return
    for line in tables(record, _load(os.path.join(FOLDER, "previous.json"))):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"durations written to {os.path.relpath(os.path.join(FOLDER, 'latest.json'), ROOT)}")


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(FOLDER, "latest.json")
    previous = _load(sys.argv[2]) if len(sys.argv) > 2 else None
    print("\n".join(tables(_load(path), previous, markdown=True)))
