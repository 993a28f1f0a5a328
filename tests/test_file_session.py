"""The directory session (`session/files.py`): the rendezvous handshake through files, in one process.

Each side runs on its own thread against a real directory; every check reads what
the files say (tickets, answers, the live session) or what a rank raised.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_sync.core.errors import PeerFailureError, RendezvousError
from megatron_sync.core.wait import poll
from megatron_sync.session import files
from megatron_sync.session.board import BoardGather
from megatron_sync.session.rendezvous import Identity
from megatron_sync.session.secret import SessionSecret
from tests.support.timing import bounded, scaled

pytestmark = pytest.mark.timeout(120)

EXPECTS = {"transport": "disk_delta", "num_inference_ranks": 1, "trainer_stages": 1, "dtype": "bfloat16"}


def _rendezvous(role: str, member: int = 0, *, timeout_s: float = 20, secret: str = "", **expects) -> files.FileRendezvous:
    identity = Identity(job=f"{role}-job", role=role, member=member, expects={**EXPECTS, "backend": role, **expects})
    return files.presenting(identity, timeout_s=timeout_s, secret=SessionSecret(secret) if secret else None)


def _host(folder: str, *, inference: int = 1, **kwargs) -> files.FileSession:
    return _rendezvous("trainer", **kwargs).host(folder, members={"trainer": 1, "inference": inference},
                                                 details={"version_offset": 9})


def test_every_rank_is_admitted_with_the_details_and_the_backend_is_not_compared(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(2) as pool:
        joining = [pool.submit(_rendezvous("inference", r, num_inference_ranks=2).join, folder) for r in range(2)]
        hosted = _host(folder, inference=2, num_inference_ranks=2)
        joined = [f.result(timeout=20) for f in joining]
    assert {s.id for s in joined} == {hosted.id} and joined[0].details == {"version_offset": 9}
    assert joined[0].host.job == "trainer-job" and "backend" not in joined[0].host.expects  # trainer vs inference
    answers = [json.loads(open(os.path.join(hosted.folder, "answers", name)).read())
               for name in sorted(os.listdir(os.path.join(hosted.folder, "answers")))]
    assert [a["accepted"] for a in answers] == [True, True]
    assert os.path.exists(os.path.join(hosted.folder, "ready"))


def test_a_session_left_by_an_earlier_run_is_never_joined(tmp_path, monkeypatch):
    folder = str(tmp_path / "control")
    stale = files.FileSession("old", folder, Identity(job="old-trainer", role="trainer", member=0, session="old"), {})
    os.makedirs(os.path.join(stale.folder, "tickets"))
    with open(os.path.join(folder, files.SESSION), "wb") as f:
        f.write(stale.to_json())
    looked_again = _read_again_after_presenting(monkeypatch, os.path.join(stale.folder, "tickets"))
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(_rendezvous("inference").join, folder)
        poll(lambda: looked_again.is_set() or joining.done(), within=scaled(20),
             what="the joiner reading session.json again after presenting itself to the stale session")
        assert looked_again.is_set() and not joining.done()  # nobody answers the stale session's tickets
        live = _host(folder)
        joined = joining.result(timeout=20)
    assert joined.id == live.id != "old" and joined.details["version_offset"] == 9
    assert not os.path.exists(stale.folder)


def _read_again_after_presenting(monkeypatch, tickets: str) -> threading.Event:
    """Return an event set when a joiner reads session.json while its ticket is in `tickets`: it presented
    itself, looked for the answer and went round its wait again (the real read runs)."""
    real, looked_again = files.read_session, threading.Event()

    def read_session(control_dir: str):
        if os.path.isdir(tickets) and os.listdir(tickets):
            looked_again.set()
        return real(control_dir)

    monkeypatch.setattr(files, "read_session", read_session)
    return looked_again


def test_ranks_of_an_old_session_fail_when_a_new_trainer_opens_one(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(_rendezvous("inference").join, folder)
        old = _host(folder)
        joining.result(timeout=20)
        board = files.directory_board(old.folder, rank=1, timeout_s=30, alive=files.liveness_check(old))
        waiting = pool.submit(board.fetch, "control/1")
        # noticed within about a second (the liveness check), not at the board's 30 s timeout
        with bounded(5, "the old session's waiting rank noticing the new run") as bound:
            with pytest.raises(RendezvousError, match=r"still missing inference ranks \[0\]"):  # nobody joins it
                _host(folder, timeout_s=0.2)
            with pytest.raises(PeerFailureError, match=f"session {old.id} in .* is over: a new trainer run opened"):
                waiting.result(timeout=bound.deadline.remaining(floor=0.01))


def test_the_leader_names_the_ranks_that_never_joined_and_tells_latecomers(tmp_path):
    folder = str(tmp_path / "control")
    with pytest.raises(RendezvousError, match=r"within 0.3s: still missing inference ranks \[0, 1\]"):
        _host(folder, inference=2, timeout_s=0.3, num_inference_ranks=2)
    with pytest.raises(RendezvousError, match=r"session .* failed: not every rank joined .*; no newer session came "
                                              r"within 0.5s"):
        _rendezvous("inference", timeout_s=0.5, num_inference_ranks=2).join(folder)  # an earlier run's, maybe


def test_a_rank_with_other_settings_is_refused_and_the_session_fails_quoting_it(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(_rendezvous("inference", trainer_stages=2, dtype="float16").join, folder)
        with pytest.raises(RendezvousError, match="has 1 pipeline stages, this inference job expects 2.*sends dtype "
                                                  "'bfloat16', this inference job computes in 'float16'"):
            _host(folder)
        with pytest.raises(RendezvousError, match="refused this rank: inference rank 0 of job 'inference-job' "
                                                  "cannot join session"):
            joining.result(timeout=20)


def test_a_rank_without_the_session_secret_is_refused_and_the_session_goes_on(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(2) as pool:
        hosting = pool.submit(_host, folder, secret="s3cret")
        with pytest.raises(RendezvousError, match="presents no session secret, but session .* requires one"):
            _rendezvous("inference", member=0).join(folder)
        with pytest.raises(RendezvousError, match="proves another session secret than this job's"):
            _rendezvous("inference", member=0, timeout_s=1, secret="guess").join(folder)  # never presents
        assert not hosting.done()  # refused strangers leave the session undisturbed
        joined = _rendezvous("inference", member=0, secret="s3cret").join(folder)
        assert hosting.result(timeout=20).id == joined.id


def test_a_rank_holding_a_secret_never_presents_to_a_trainer_without_it(tmp_path):
    folder = str(tmp_path / "control")
    with ThreadPoolExecutor(1) as pool:
        hosting = pool.submit(_host, folder, timeout_s=scaled(3))
        poll(lambda: files.read_session(folder), within=scaled(20), what="the trainer opening its session")
        with pytest.raises(RendezvousError, match="runs session .* without a session secret, but this job has"):
            _rendezvous("inference", timeout_s=1, secret="s3cret").join(folder)
        with pytest.raises(RendezvousError, match=r"still missing inference ranks \[0\]"):
            hosting.result(timeout=20)
    assert os.listdir(os.path.join(files.read_session(folder).folder, "tickets")) == []


def test_the_gather_over_a_directory_board_returns_every_rank_in_order_and_cleans_up(tmp_path):
    board_dir = str(tmp_path / "session")
    gathers = [BoardGather(files.directory_board(board_dir, rank=r, timeout_s=20), name="g", index=r, size=3)
               for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        for round_ in range(1, 5):
            futures = [pool.submit(g, {"rank": r, "round": round_}) for r, g in enumerate(gathers)]
            assert all(f.result(timeout=20) == [{"rank": r, "round": round_} for r in range(3)] for f in futures)
    assert os.listdir(os.path.join(board_dir, "board", "gather", "g")) == ["4"]  # earlier rounds are gone
    assert sorted(os.listdir(os.path.join(board_dir, "board", "gather", "g", "4"))) == ["0", "1", "2"]
