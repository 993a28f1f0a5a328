"""The parts of `make gpu-check` (bench/gpu_check.py) that need no CUDA: its table, its verdict, its reading
of the test report, and its checks' own logic on the CPU."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check
from bench.gpu_check import Row, exit_status, table, rows_of_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="1.0"/>
<testcase classname="tests.test_a" name="test_bad" time="1.0"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_b" name="test_two_gpus" time="0.0"><skipped message="needs 2 CUDA devices"/></testcase>
<testcase classname="tests.test_b" name="test_err" time="0.0"><error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>"""


def test_a_report_counts_each_outcome_and_names_every_failure(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)
    rows = rows_of_report(str(path), returncode=1)
    assert rows[0] == Row("gpu-marked tests", "FAILED", "1 passed, 2 failed, 1 skipped")
    assert [r.check.strip() for r in rows[1:]] == ["tests.test_a::test_bad", "tests.test_b::test_err"]
    assert rows[1].detail == "assert 1 == 2" and exit_status(rows) == 1


def test_no_report_is_a_failure_and_no_tests_collected_is_not(tmp_path):
    assert rows_of_report(str(tmp_path / "missing.xml"), 0)[0].failed
    empty = tmp_path / "e.xml"
    empty.write_text('<testsuites><testsuite name="pytest"/></testsuites>')
    assert not rows_of_report(str(empty), returncode=5)[0].failed  # pytest's "no tests collected"


def test_skipped_rows_do_not_fail_and_the_table_aligns():
    rows = [Row("a", "ok", "1.0 GB/s", "x"), Row("longer check", "skipped: no CUDA"), Row("b", "FAILED", "", "why")]
    lines = table(rows).splitlines()
    assert lines[0].startswith("check") and set(lines[1]) == {"-"}
    assert lines[2].index("ok") == lines[3].index("skipped") == lines[4].index("FAILED")
    assert exit_status(rows[:2]) == 0 and exit_status(rows) == 1


def test_the_checksum_check_compares_real_bytes_and_a_raising_check_is_a_failed_row():
    row = gpu_check.checksum_row("cpu")
    assert row.status == "ok" and "GB/s" in row.figure

    def broken(device: str) -> Row:
        raise RuntimeError("planted")

    failed = gpu_check.check("broken", lambda: broken("cpu"))
    assert failed.failed and "planted" in failed.detail


@pytest.mark.multiproc  # the NIXL check writes from this process into a window another process exposes
def test_without_cuda_the_script_refuses_unless_allowed_and_writes_its_table(tmp_path, capsys):
    assert gpu_check.main(["--skip-tests", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--allow-cpu", "--skip-tests", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "device checksum = host checksum" in out and "skipped: no CUDA" in out
    assert next(r for r in json.loads((tmp_path / "gpu-check.json").read_text())
                if r["check"] == "host copy of one staging set")["status"] == "ok"
    rows = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {r["check"] for r in rows} >= {"device checksum = host checksum", "CUDA IPC", "NCCL broadcast"}
    nixl = next(r for r in rows if r["check"] == "P2P arena (NIXL, device memory)")
    assert nixl["status"] == "ok" and "DRAM to DRAM" in nixl["detail"], nixl  # host memory here: the same path


@pytest.mark.multiproc  # runs pytest in a process of its own, as on the GPU machine
def test_tests_picks_the_gpu_tests_a_second_call_runs(tmp_path):
    """`--tests nixl`: the second device call, which brings NIXL, runs only the NIXL gpu test (skipped here,
    with the gpu tier, for lack of CUDA), not the whole tier again."""
    rows = gpu_check.run_gpu_tests(str(tmp_path), 300, "nixl")
    # one test of the gpu tier's eight: the -k expression reached pytest
    assert rows == [Row("gpu-marked tests", "ok", "0 passed, 0 failed, 1 skipped")], rows
