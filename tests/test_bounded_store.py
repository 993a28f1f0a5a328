"""Store calls against a host that is stopped (SIGSTOP), not dead: bounded by timeout_s, named, and known after.

A real TCPStore hosted by a real session in a child process, which the test stops. The negative
control shows why `transport/store.py` exists: the plain client's `check` is still blocked long after
its own timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from examples.demo import stopped
from megatron_sync.core.wait import ManualClock, poll, using_clock
from megatron_sync.core.errors import StoreSilentError
from megatron_sync.session.session import connect
from megatron_sync.session.store import CHECK_EVERY_S, MIN_BOUND_S
from tests.support.dist import free_port

TIMEOUT_S = 3.0

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

HOST = """
import sys, threading
from megatron_sync.session.rendezvous import Identity
from megatron_sync.session.session import SyncSession
SyncSession.host("127.0.0.1", {port}, Identity(job="T", role="trainer", member=0), members={{"trainer": 1}},
                 timeout_s={timeout})
print("hosting", flush=True)
threading.Event().wait(600)  # host until the test stops it, then kills it
"""


@contextlib.contextmanager
def _hosting():
    """Yield (port, process) of a session host in a child process, once it hosts; kill it afterwards."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST.format(port=port, timeout=TIMEOUT_S)], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert host.stdout.readline().strip() == "hosting"
        yield port, host
    finally:
        host.kill()
        host.wait(30)


@pytest.fixture
def running_host():
    """Yield the port of a running session host; it is killed afterwards."""
    with _hosting() as (port, _):
        yield port


@pytest.fixture
def stopped_host():
    """Yield the port of a session host that is then stopped; the host is killed afterwards."""
    with _hosting() as (port, host):
        client = connect("127.0.0.1", port, timeout_s=TIMEOUT_S)
        assert client.check(["rdzv/session"])  # it answers while it runs
        os.kill(host.pid, signal.SIGSTOP)
        # the signal is delivered asynchronously: a host still running on the other core could answer one more
        # call, so wait until the kernel reports it stopped
        poll(lambda: stopped([host.pid]), within=30, what="the host process stopping")
        yield port, client


def test_every_call_ends_within_timeout_s_and_later_calls_fail_at_once(stopped_host):
    """On the wait helper's clock (a manual one: exact, and quick): the first call gives up when its host has
    been silent for exactly timeout_s; every later call fails without waiting."""
    _, client = stopped_host
    with using_clock(ManualClock()) as clock:
        with pytest.raises(StoreSilentError, match=r"accepts connections but has not answered for 3[.0-9]*s \(check "
                                                   r"\['rdzv/ready'\]\): its host is stopped \(e\.g\. SIGSTOP\) or hung"):
            client.check(["rdzv/ready"])
        assert clock.now() == pytest.approx(TIMEOUT_S, abs=CHECK_EVERY_S)
        for call in (lambda: client.get("rdzv/session"), lambda: client.add("rdzv/acks", 1),
                     lambda: client.set("x", b"1")):
            before = clock.now()
            with pytest.raises(StoreSilentError):
                call()
            assert clock.now() == before  # known silent: nobody waits for it a second time
    assert client.silent


def test_a_shorter_bound_raises_without_declaring_the_host_silent(stopped_host):
    _, client = stopped_host
    with using_clock(ManualClock()) as clock:
        with pytest.raises(StoreSilentError, match=r"did not answer \(check \['rdzv/ready'\]\) within 2s"):
            client.check(["rdzv/ready"], bound=0.1)  # MIN_BOUND_S: never less than 2 s
        assert clock.now() == pytest.approx(MIN_BOUND_S, abs=CHECK_EVERY_S)
        assert not client.silent
        with pytest.raises(StoreSilentError, match="has not answered for"):  # queued behind the stuck call:
            client.get("rdzv/session")  # silent once that call is timeout_s old, not timeout_s after this one
        assert clock.now() == pytest.approx(TIMEOUT_S, abs=CHECK_EVERY_S)


def test_negative_control_the_plain_client_is_still_blocked_long_after_its_timeout(stopped_host):
    _, client = stopped_host
    done = threading.Event()

    def plain_check() -> None:
        try:
            client.raw.check(["rdzv/ready"])  # the c10d client itself, timeout=3s
        except Exception:  # noqa: BLE001 — only whether it returns matters
            pass
        done.set()

    threading.Thread(target=plain_check, daemon=True).start()
    assert not done.wait(3 * TIMEOUT_S)  # no bound: it returns only when the host dies (the fixture kills it)


def _blocking_board(port: int):
    from megatron_sync.session.board import store_board

    return store_board(connect("127.0.0.1", port, timeout_s=TIMEOUT_S), prefix="t/", rank=1, timeout_s=TIMEOUT_S,
                       blocking=True)


def test_a_blocking_board_takes_what_is_posted_and_names_the_key_when_nothing_is(running_host):
    """A blocking board (the control channel's) waits in the store's own wait on a connection of its own: it
    returns what another client posts, in whichever order the two happen, and a wait that sees nothing raises
    naming the key."""
    from megatron_sync.core.errors import PeerFailureError

    waiting, poster = _blocking_board(running_host), _blocking_board(running_host)
    got = {}
    reader = threading.Thread(target=lambda: got.update(value=waiting.fetch("control/1", 60)), daemon=True)
    reader.start()
    poster.post("control/1", b"sync 1")
    reader.join(60)
    assert got == {"value": b"sync 1"}
    with pytest.raises(PeerFailureError, match=r"nothing was posted under 'control/2' within 0.3s"):
        waiting.fetch("control/2", 0.3)  # several slices when the timeout is longer: here one, cut short
    waiting.close()
    poster.close()


def test_a_blocking_wait_on_a_stopped_host_raises_store_silent_instead_of_hanging(stopped_host):
    """An engine idle on the control channel of a trainer that is then stopped: its waiting thread's own
    connection (made at its first wait) and the wait itself are bounded calls, so it is told, not left hanging."""
    from megatron_sync.session.board import store_board

    _, client = stopped_host  # connected while the host ran
    board = store_board(client, prefix="t/", rank=1, timeout_s=TIMEOUT_S, blocking=True)
    # after timeout_s (3 s), not a shorter bound (2 s); which of the two wordings depends on which check ends
    # the bounded call first: the host's silence for timeout_s, or the call's own limit of timeout_s
    with pytest.raises(StoreSilentError, match=r"has not answered for 3[.0-9]*s|did not answer \(.*\) within 3s"):
        board.fetch("control/1", 60)


def test_a_host_stopped_during_a_blocking_wait_is_known_silent_to_every_call_of_the_client():
    """A P2P receiver waits for a round's report on its thread's own connection, made while the trainer ran; the
    trainer is then stopped. Once that wait found the host silent, the receiver's other calls (telling the ranks
    it relays to that it gives up) fail at once instead of waiting another timeout_s each."""
    from megatron_sync.session.board import store_board

    with _hosting() as (port, host):
        client = connect("127.0.0.1", port, timeout_s=TIMEOUT_S)
        board = store_board(client, prefix="t/", rank=1, timeout_s=TIMEOUT_S, blocking=True)
        board.post("report/0", b"ok")
        assert board.fetch("report/0", 60) == b"ok"  # this thread's connection is made, while the host runs
        os.kill(host.pid, signal.SIGSTOP)
        poll(lambda: stopped([host.pid]), within=30, what="the host process stopping")
        with pytest.raises(StoreSilentError, match=r"has not answered for 3[.0-9]*s|did not answer \(.*\) within 3s"):
            board.fetch("report/1", 60)
        assert client.silent
        with using_clock(ManualClock()) as clock:
            with pytest.raises(StoreSilentError, match="has not answered for"):
                board.post("report/abort", b"gave up")
            assert clock.now() == 0


class _LeavesBeforeCleanup:
    """A board whose store host leaves just before this rank removes its post of the round before: the host's
    own rank finished the last gather (`done`), and its job exits."""

    def __init__(self, board, host, done) -> None:
        self.board, self.host, self.done = board, host, done

    def post(self, key, value):
        self.board.post(key, value)

    def fetch(self, key, *args, **kwargs):
        return self.board.fetch(key, *args, **kwargs)

    def remove(self, key):
        self.done.result(timeout=30)
        self.host.kill()
        self.host.wait(30)
        self.board.remove(key)


def test_a_gather_whose_host_leaves_before_the_last_cleanup_still_returns_every_rank():
    """The ipc transport's all-gather goes through the store: a rank removes its post of round r - 1 once it read
    every post of round r. After the last round the host may already be gone; the gather's values are whole,
    so that clean-up must not fail the sync (it did: `Connection reset by peer` in a fresh-clone run)."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_sync.session.board import BoardGather, store_board

    with _hosting() as (port, host), ThreadPoolExecutor(2) as pool:
        boards = [store_board(connect("127.0.0.1", port, timeout_s=TIMEOUT_S), prefix="t/", rank=r,
                              timeout_s=TIMEOUT_S) for r in range(2)]
        gathers = [BoardGather(board, name="g", index=r, size=2) for r, board in enumerate(boards)]
        assert [f.result(timeout=30) for f in [pool.submit(g, r) for r, g in enumerate(gathers)]] == [[0, 1]] * 2
        first = pool.submit(gathers[0], 10)  # the last round
        gathers[1].board = _LeavesBeforeCleanup(boards[1], host, first)
        assert gathers[1](11) == [10, 11]
        assert first.result(timeout=30) == [10, 11]


class _FinishingThenStuck:
    """A stand-in for a c10d client whose host stops between two calls: `check(["slow"])` returns once the
    test's own call has waited a second (the helper was finishing it when the test asked), `check(["stuck"])`
    never returns until the test ends (no answer from a stopped host)."""

    def __init__(self, clock: "_MainWaits") -> None:
        self.clock, self.entered, self.ended = clock, threading.Event(), threading.Event()

    def check(self, keys):
        if keys == ["slow"]:
            self.entered.set()
            self.clock.main_waiting.wait(30)
            self.clock.sleep(1.0)
            return True
        self.ended.wait(60)
        return False


class _MainWaits(ManualClock):
    """A manual clock that says when the test's own thread first waited on it."""

    def __init__(self) -> None:
        super().__init__()
        self.main_waiting = threading.Event()

    def wait_event(self, event, seconds):
        if threading.current_thread() is threading.main_thread():
            self.main_waiting.set()
        return super().wait_event(event, seconds)


def test_a_call_unanswered_for_timeout_s_makes_the_host_silent_though_the_helper_began_it_late():
    """The call asked while the helper still finished another one: the helper begins it a second later, so when
    the caller has waited timeout_s the call is only timeout_s - 1 old. It is still the host's silence (every
    later call fails at once), not a slow answer each later call waits out again (an engine rank giving up
    after a stopped trainer then waited another timeout_s on its first notice)."""
    from megatron_sync.session.store import BoundedStore

    with using_clock(_MainWaits()) as clock:
        raw = _FinishingThenStuck(clock)
        store = BoundedStore(raw, where="the stopped host", timeout_s=TIMEOUT_S)
        try:
            finishing = threading.Thread(target=lambda: store.check(["slow"]), daemon=True)
            finishing.start()
            assert raw.entered.wait(30)
            with pytest.raises(StoreSilentError, match=r"has not answered for 3[.0-9]*s \(check \['stuck'\]\)"):
                store.check(["stuck"])
            assert store.silent
            before = clock.now()
            with pytest.raises(StoreSilentError):
                store.check(["abort"])
            assert clock.now() == before
        finally:
            raw.ended.set()
            finishing.join(30)


class _Receives:
    """A two-sided mover's receives as the receiver posts them for a version: each one's waits are counted."""

    two_sided = True

    def __init__(self) -> None:
        self.waited = 0

    def expect(self, source, window, spans):
        return SimpleNamespace(wait=lambda timeout_s: setattr(self, "waited", self.waited + 1))


@pytest.mark.parametrize("two_sided", [False, True], ids=["one-sided", "two-sided"])
def test_a_chained_receiver_whose_notice_store_stops_names_the_store_not_the_engine_before_it(two_sided):
    """An engine rank chained behind another engine waits for that engine's report of a round on the trainer's
    store, and the trainer is stopped. The store is silent, so the transport is broken: the rank raises the
    store's silence (a PeerFailureError the engine words as a stopped trainer), not "the engine forwarding to
    this rank sent nothing", which aborts the version alone and agrees on it with the stopped trainer's ranks
    (another timeout_s). It does not give the version up either: with a two-sided mover that would wait on each
    receive it posted (timeout_s each; nothing will come from a stopped trainer)."""
    import torch

    from megatron_sync.session.board import store_board
    from megatron_sync.transports.p2p.notices import Notices
    from megatron_sync.transports.p2p.rounds import RoundReceiver
    from tests.p2p_support import ref, schedule_of

    _, schedule = schedule_of("qwen3", [ref(1), ref(1)], dict(tp=1), piece_bytes=4096)
    assert schedule.feeds[1] == 0  # the second engine's rank is fed by the first's
    with _hosting() as (port, host):
        board = store_board(connect("127.0.0.1", port, timeout_s=TIMEOUT_S), prefix="t/", rank=1,
                            timeout_s=TIMEOUT_S, blocking=True)
        notices = Notices(board, 1, 1)
        mover = _Receives() if two_sided else SimpleNamespace(two_sided=False)
        rounds = RoundReceiver(schedule, 1, mover, torch.empty(0, dtype=torch.uint8), algorithm="xxh3",
                               timeout_s=TIMEOUT_S)
        failed = {}

        def receive():
            try:
                rounds.receive_version(notices, torch.empty(schedule.receivers[1].layout.nbytes, dtype=torch.uint8), 0)
            except Exception as e:  # noqa: BLE001 — what it raised is the test's subject
                failed["error"] = e

        receiving = threading.Thread(target=receive, daemon=True)
        receiving.start()
        board.fetch("p2p/v1.1/base/1", 60)  # it posted where the engine before it writes: it now waits for a report
        os.kill(host.pid, signal.SIGSTOP)
        poll(lambda: stopped([host.pid]), within=30, what="the host process stopping")
        receiving.join(60)
        assert not receiving.is_alive()
    error = failed.get("error")
    assert isinstance(error, StoreSilentError), repr(error)
    # in the wait for the report, or in connecting the waiting thread's own client first if the stop came before
    assert re.search(r"has not answered for 3[.0-9]*s \((get \['t/p2p/v1\.1/report/1/0/receiver/0'\]|connect a "
                     r"second client)\)", str(error)), str(error)
    if two_sided:
        assert mover.waited == 0  # no posted receive was drained
