"""What `poll` takes as a result: a test that polls for "the failures recorded so far" must not return at once
with an empty record (a loaded CI run did, and synced on before the failure it waited for)."""

from __future__ import annotations

import pytest

from megatron_sync.core.wait import WaitTimeout, poll


@pytest.mark.parametrize("not_yet", [None, False, {}, [], "", set()], ids=repr)
def test_nothing_and_empty_containers_are_not_results(not_yet):
    with pytest.raises(WaitTimeout, match="the thing"):
        poll(lambda: not_yet, within=0.0, what="the thing")


@pytest.mark.parametrize("result", [0, 0.0, True, {2: "failed"}, [None], "x"], ids=repr)
def test_anything_else_is_the_result(result):
    assert poll(lambda: result, within=0.0, what="the thing") == result


def test_poll_returns_the_first_result_after_calls_that_were_not_yet():
    answers = iter([None, {}, [], {3: "ok"}])
    assert poll(lambda: next(answers), within=60.0, what="the thing", max_pause_s=0.0) == {3: "ok"}


def test_pauses_start_at_the_first_pause_and_double_up_to_the_longest():
    from megatron_sync.core.wait import ManualClock, using_clock

    answers = iter([None] * 6 + ["done"])
    with using_clock(ManualClock()) as clock:
        assert poll(lambda: next(answers), within=60.0, what="a write", first_pause_s=0.0001,
                    max_pause_s=0.001) == "done"
    assert clock.sleeps == pytest.approx([0.0001, 0.0002, 0.0004, 0.0008, 0.001, 0.001])
