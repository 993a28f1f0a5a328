"""The real rendezvous (TCPStore, sockets, threads): refusals, faults and failures reach both sides at once.

Every rank here is a thread of the test process talking to a real store over
loopback, through the same `SyncSession` / `transport_group_over` the drivers
use. Each case bounds how long each side takes to fail and checks the text
names the mismatch or the fault. A bound says "fails long before timeout_s"
(scaled for load, `tests/support/timing.py`); a wait that must last its bound
runs on a manual clock.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import pytest
import torch

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.wait import ManualClock, poll, using_clock
from megatron_sync.core.errors import RendezvousError
from megatron_sync.convert.model_digest import model_fields
from megatron_sync.session.group import init_transport_group, transport_group_over
from megatron_sync.session.rendezvous import Identity, expectations
from megatron_sync.session.liveness import LIVE_WITHIN_S
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import SyncSession, report_failure
from tests.support.dist import free_port
from tests.support.models import ModelSpec, hf_config
from tests.support.timing import bounded, scaled

TIMEOUT_S = 20.0  # the sessions' timeout_s: every failure below must come well before it
QUICK_S = 6.0


def _config(**changes) -> WeightSyncConfig:
    return WeightSyncConfig(**{"family": "qwen3", "num_inference_ranks": 2, "engine_tp_size": 2,
                               "dtype": "float32", "backend": "gloo", **changes})


def _identity(role: str, member: int, job: str, config: WeightSyncConfig, *, stages: int = 1,
              model=None, session=None, engine: Optional[int] = None) -> Identity:
    return Identity(job=job, role=role, member=member, session=session, engine=engine,
                    expects=expectations(config, trainer_stages=stages, backend="gloo"),
                    model=model_fields(model if model is not None else hf_config(ModelSpec("qwen3"))))


def _host(port: int, config: WeightSyncConfig, *, stages: int = 1, model=None,
          secret: Optional[SessionSecret] = None) -> SyncSession:
    me = _identity("trainer", 0, "T", config, stages=stages, model=model, session="run-1")
    fleet = {"members": {"trainer": 1}, "engine_ranks": config.engine_tp_size} if config.fleet else \
        {"members": {"trainer": 1, "inference": config.num_inference_ranks}}
    return SyncSession.host("127.0.0.1", port, me, timeout_s=TIMEOUT_S, secret=secret, **fleet)


def _join(port: int, member: int, job: str, config: WeightSyncConfig, *, secret: Optional[SessionSecret] = None,
          ready: bool = True, **kw) -> SyncSession:
    session = SyncSession.join("127.0.0.1", port, _identity("inference", member, job, config, **kw),
                               timeout_s=TIMEOUT_S, secret=secret)
    if ready:
        session.wait_ready()
    return session


def _outcome(fn, *args, bound_s: float = QUICK_S, **kw) -> tuple[Any, Optional[Exception]]:
    """Return (fn's value, None) or (None, the exception it raised); the call must end within `bound_s`
    (scaled for load), else BoundExceeded."""
    with bounded(bound_s, getattr(fn, "__qualname__", repr(fn))):
        try:
            return fn(*args, **kw), None
        except Exception as e:  # noqa: BLE001 — the test inspects it
            return None, e


def _until_admitted(host: SyncSession, count: int) -> None:
    """Wait until the host admitted `count` inference ranks (within timeout_s, scaled)."""
    poll(lambda: len(host._admission.admitted.get("inference", {})) >= count, within=scaled(TIMEOUT_S),
         what=f"{count} inference ranks being admitted")


@pytest.mark.parametrize("trainer, engine, words", [
    ({}, {"num_inference_ranks": 1, "engine_tp_size": 1},
     "trainer expects 2 inference ranks, this inference job has 1"),
    ({"stages": 2}, {"stages": 1}, "trainer has 2 pipeline stages, this inference job expects 1"),
    ({"model": {**hf_config(ModelSpec("qwen3")).to_dict(), "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1e6}}}, {},
     "the models differ in rope_parameters.rope_theta: trainer 1000000.0, this inference job 10000.0"),
], ids=["inference-ranks-2-vs-1", "trainer-pp2-vs-1-stage", "rope-theta"])
def test_a_disagreeing_inference_job_is_refused_and_both_sides_fail_within_seconds(trainer, engine, words):
    port = free_port()
    stages = trainer.pop("stages", 1)
    host = _host(port, _config(), stages=stages, **trainer)
    try:
        engine_stages = engine.pop("stages", 1)
        config = _config(**engine)
        _, joined = _outcome(_join, port, 0, "E", config, stages=engine_stages)
        _, hosted = _outcome(host.wait_ready)
    finally:
        host.close()
    assert isinstance(joined, RendezvousError) and words in str(joined), joined
    assert "refused this rank" in str(joined)
    assert isinstance(hosted, RendezvousError) and words in str(hosted), hosted


def test_a_second_job_is_refused_by_session_name_while_the_first_forms_its_group_undisturbed():
    port = free_port()
    config = _config()
    host = _host(port, config)

    def first_job_rank(member: int):
        session = _join(port, member, "E1", config)
        group = transport_group_over(session, 3, 1 + member, timeout=TIMEOUT_S, group_name="t")
        data = torch.zeros(4)
        group.broadcast(data, src=0)
        group.close()
        session.close()
        return data

    try:
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(first_job_rank, m) for m in (0, 1)]
            _until_admitted(host, 2)
            second = [pool.submit(_outcome, _join, port, m, "E2", config) for m in (0, 1)]
            host.wait_ready()
            group = transport_group_over(host, 3, 0, timeout=TIMEOUT_S, group_name="t")
            group.broadcast(torch.arange(4.0), src=0)
            received = [f.result(timeout=TIMEOUT_S) for f in first]
            refused = [f.result(timeout=TIMEOUT_S) for f in second]
            group.close()
    finally:
        host.close()
    assert all(torch.equal(r, torch.arange(4.0)) for r in received)
    for _, error in refused:
        assert isinstance(error, RendezvousError), error
        assert "session 'run-1' already has inference job 'E1'" in str(error)
        assert "this inference job 'E2' is refused" in str(error)


def test_an_engine_that_fails_while_starting_fails_the_trainer_at_once_quoting_it():
    port = free_port()
    host = _host(port, _config())
    try:
        first = SyncSession.join("127.0.0.1", port, _identity("inference", 0, "E", _config()),
                                 timeout_s=TIMEOUT_S)  # rank 0 joined; rank 1 fails while building its engine
        why = "ValueError: Qwen3ForCausalLM cannot be instantiated under `dtype=torch.int8`"
        assert report_failure("127.0.0.1", port, Identity(job="E", role="inference", member=1), why,
                              timeout_s=TIMEOUT_S)
        _, hosted = _outcome(host.wait_ready)
        _, joined = _outcome(first.wait_ready)
    finally:
        host.close()
    for error in (hosted, joined):
        assert isinstance(error, RendezvousError) and f"inference rank 1 of job 'E' failed while starting: {why}" \
            in str(error), error


def test_a_trainer_that_fails_while_starting_fails_the_waiting_engines_at_once_quoting_it():
    port = free_port()
    host = _host(port, _config())
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(_outcome, _join, port, m, "E", _config()) for m in (0, 1)]
        _until_admitted(host, 2)
        host.fail("the trainer failed while starting: ShapeMismatchError: model.embed_tokens.weight")
        with bounded(QUICK_S, "the failed host's close"):
            host.close()  # lingers until both engines read the failure
        outcomes = [f.result(timeout=TIMEOUT_S) for f in waiting]
    for _, error in outcomes:
        assert isinstance(error, RendezvousError), error
        assert "session run-1 failed: the trainer failed while starting: ShapeMismatchError" in str(error)


def test_a_port_in_use_is_reported_as_such_at_once():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(4)
        port = held.getsockname()[1]
        _, error = _outcome(_host, port, _config(), bound_s=2.0)
    assert isinstance(error, RendezvousError)
    assert f"cannot host the rendezvous at 127.0.0.1:{port}: the port is already in use" in str(error)
    assert "weight_sync.master_port" in str(error)


def test_a_port_held_by_something_silent_is_reported_within_the_probe_bound():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(4)  # accepts connections (the kernel does) and never answers
        port = held.getsockname()[1]
        _, error = _outcome(SyncSession.join, "127.0.0.1", port, _identity("inference", 0, "E", _config()),
                            timeout_s=3.0, bound_s=3.0 + 2.0)
    assert isinstance(error, RendezvousError), error
    assert "accepted a connection but nothing answered within 3s" in str(error)
    assert "not a megatron-sync rendezvous" in str(error)


def test_no_answer_is_reported_as_nothing_listening_within_timeout_s():
    """The joiner retries a refused connection for timeout_s on the clock (a trainer still starting), then
    names it; the manual clock makes that wait end at once and shows how long it lasted."""
    port = free_port()
    with bounded(4.0, "a join to a port nothing listens on"), using_clock(ManualClock()) as clock:
        _, error = _outcome(SyncSession.join, "127.0.0.1", port, _identity("inference", 0, "E", _config()),
                            timeout_s=2.0)
    assert isinstance(error, RendezvousError) and 2.0 <= clock.now() < 4.0, (error, clock.now())
    assert f"the rendezvous at 127.0.0.1:{port}: nothing answered for 2s (connection refused" in str(error)


def test_a_store_that_is_not_a_rendezvous_is_named():
    import datetime

    import torch.distributed as dist

    other = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    _, error = _outcome(SyncSession.join, "127.0.0.1", other.port, _identity("inference", 0, "E", _config()),
                        timeout_s=2.0, bound_s=4.0)
    assert isinstance(error, RendezvousError), error
    assert "is not a megatron-sync rendezvous (no session was posted there)" in str(error)


def test_a_bare_group_refuses_a_rank_beyond_its_world_size():
    port = free_port()

    def rank(r: int, world: int):
        group = init_transport_group("127.0.0.1", port, world, r, timeout=TIMEOUT_S, group_name="bare")
        group.close()

    with ThreadPoolExecutor(3) as pool:
        ok = [pool.submit(rank, r, 2) for r in (0, 1)]
        for f in ok:
            f.result(timeout=TIMEOUT_S)
    port = free_port()
    with ThreadPoolExecutor(3) as pool:
        host = pool.submit(_outcome, rank, 0, 2, bound_s=TIMEOUT_S)
        extra = pool.submit(_outcome, rank, 1, 3)  # a rank that thinks the group has 3
        _, error = extra.result(timeout=TIMEOUT_S)
        _, host_error = host.result(timeout=TIMEOUT_S)
    assert isinstance(error, RendezvousError), error
    assert "member expects a transport group of 2 ranks, this member job has 3" in str(error)
    assert isinstance(host_error, RendezvousError)



def test_a_group_gathers_json_of_any_length_in_rank_order():
    """Verdicts that fit `INLINE_JSON` travel in one collective, a longer one in a second: both come back
    whole, in rank order, whichever rank sends the long one."""
    from megatron_sync.session.group import INLINE_JSON

    port = free_port()
    long = "é" * INLINE_JSON  # JSON escapes each as \u00e9: six times the inline part
    rounds = [[None, None, None], ["a", {"b": [1, 2]}, None], [None, long, "c"], [long, long + "x", [long]],
              ["x" * (INLINE_JSON - 2), None, 7]]  # exactly INLINE_JSON bytes of JSON (with its quotes)

    def rank(r: int):
        group = init_transport_group("127.0.0.1", port, 3, r, timeout=TIMEOUT_S, group_name="json")
        try:
            return [group.all_gather_json(objs[r]) for objs in rounds]
        finally:
            group.close()

    with ThreadPoolExecutor(3) as pool:
        got = [f.result(timeout=TIMEOUT_S) for f in [pool.submit(rank, r) for r in range(3)]]
    for seen in got:
        assert seen == rounds


# ---- a session secret ----

SECRET_VALUE = "test-only-secret-7f3a"


def test_a_joiner_without_the_session_secret_or_with_another_is_refused_by_name_and_the_session_goes_on(caplog):
    """The trainer hosts with a secret. A job without one, and a job with another, are each refused within
    seconds naming the variable; the job with the secret then forms the session. The secret appears in no
    log line, no error and nothing the store holds."""
    caplog.set_level("INFO", logger="megatron_sync")
    port, config = free_port(), _config()
    host = _host(port, config, secret=SessionSecret(SECRET_VALUE))
    try:
        _, without = _outcome(_join, port, 0, "X", config, ready=False)
        _, other = _outcome(_join, port, 0, "Y", config, ready=False, secret=SessionSecret("some-other-secret"))
        with ThreadPoolExecutor(2) as pool:
            joining = [pool.submit(_join, port, m, "E", config, secret=SessionSecret(SECRET_VALUE)) for m in (0, 1)]
            _, hosted = _outcome(host.wait_ready)
            joined = [f.result(timeout=TIMEOUT_S) for f in joining]
        stored = [host.store.get("rdzv/session")] + [host.store.get(f"rdzv/ticket/{n}") for n in range(1, 5)]
        for session in joined:
            session.close()
    finally:
        host.close()
    assert isinstance(without, RendezvousError) and (
        "refused this rank: inference rank 0 of job 'X' presents no session secret, but session 'run-1' requires "
        "one: set MEGATRON_SYNC_SECRET in this job's environment to the trainer's") in str(without), without
    assert isinstance(other, RendezvousError) and (
        "inference rank 0 of job 'Y' presents another session secret than session 'run-1''s: set "
        "MEGATRON_SYNC_SECRET to the same value on both jobs") in str(other), other
    assert hosted is None  # the refusals failed nothing: the rightful job completed the session
    shown = caplog.text + str(without) + str(other) + b"".join(stored).decode()
    assert "presents no session secret" in caplog.text and SECRET_VALUE not in shown


def test_a_job_with_a_secret_does_not_join_a_host_without_one():
    port, config = free_port(), _config()
    host = _host(port, config)
    try:
        _, error = _outcome(_join, port, 0, "E", config, ready=False, secret=SessionSecret(SECRET_VALUE))
    finally:
        host.close()
    assert isinstance(error, RendezvousError) and "refused this rank: inference rank 0 of job 'E' presents a " \
        "session secret, but session 'run-1' runs without one: set MEGATRON_SYNC_SECRET on the trainer too" \
        in str(error), error


# ---- a fleet: one live job per engine id ----

def _fleet_config() -> WeightSyncConfig:
    return _config(fleet=True, num_inference_ranks=1, engine_tp_size=1)


def test_a_second_live_engine_with_the_same_id_is_refused_and_one_that_left_is_superseded():
    """Engine job E1 holds engine id 0 and answers: E2 presenting id 0 is refused at once, naming E1, and E1
    keeps its seat. Once E1 has left, E3 presenting id 0 is admitted as its next generation."""
    port, config = free_port(), _fleet_config()
    host = _host(port, config)
    try:
        host.wait_ready()  # a fleet's session is ready with the trainer alone; engines join whenever they come
        first, _ = _outcome(_join, port, 0, "E1", config, engine=0)
        _, duplicate = _outcome(_join, port, 0, "E2", config, engine=0)
        held = host.admitted_engines()
        first.close()  # E1 leaves (it says so): its seat is free at once
        restarted, error = _outcome(_join, port, 0, "E3", config, engine=0)
        admitted = host.admitted_engines()
        if restarted is not None:
            restarted.close()
    finally:
        host.close()
    assert first is not None and first.generation == 0
    assert isinstance(duplicate, RendezvousError) and (
        "engine 0 of session 'run-1' is held by job 'E1' (generation 0), which still answers; this job 'E2' "
        "presenting the same engine id is refused") in str(duplicate), duplicate
    assert held == {0: (0, "E1")}
    assert error is None and restarted.generation == 1 and admitted == {0: (1, "E3")}, error


KILLED_ENGINE = """
import sys
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.session.rendezvous import Identity, expectations
from megatron_sync.session.session import SyncSession
config = WeightSyncConfig.from_dict({config!r})
me = Identity(job="E1", role="inference", member=0, engine=0, expects=expectations(config, trainer_stages=1,
              backend="gloo"))
SyncSession.join("127.0.0.1", {port}, me, timeout_s={timeout})
print("joined", flush=True)
sys.stdin.read()  # holds engine 0 until the test kills it
"""


@pytest.mark.multiproc
def test_an_engine_whose_job_was_killed_is_superseded_by_its_restart():
    """E1 holds engine 0 and is killed (SIGKILL: it says nothing). E2, its restart, is admitted as generation 1
    once E1's rank has not answered within LIVE_WITHIN_S."""
    import dataclasses
    import subprocess
    import sys

    port, config = free_port(), _fleet_config()
    host = SyncSession.host("127.0.0.1", port, Identity(job="T", role="trainer", member=0, session="run-1",
                                                         expects=expectations(config, trainer_stages=1,
                                                                              backend="gloo")),
                            members={"trainer": 1}, engine_ranks=1, timeout_s=TIMEOUT_S)
    host.wait_ready()
    script = KILLED_ENGINE.format(config=dataclasses.asdict(config), port=port, timeout=TIMEOUT_S)
    engine = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "joined"
        engine.kill()
        engine.wait(timeout=30)
        me = Identity(job="E2", role="inference", member=0, engine=0,
                      expects=expectations(config, trainer_stages=1, backend="gloo"))
        restarted, error = _outcome(SyncSession.join, "127.0.0.1", port, me, timeout_s=TIMEOUT_S,
                                    bound_s=LIVE_WITHIN_S + QUICK_S)
        admitted = host.admitted_engines()
        if restarted is not None:
            restarted.close()
    finally:
        engine.kill()
        host.close()
    assert error is None and restarted.generation == 1 and admitted == {0: (1, "E2")}, error


def test_the_inference_driver_presents_the_secret_of_its_environment(monkeypatch):
    """`InferenceWeightSync` reads MEGATRON_SYNC_SECRET once and proves it: with another value in its
    environment it is refused by name, within seconds, before anything else is built."""
    from megatron_sync.drivers.sync import InferenceWeightSync
    from tests.support.fakes import FakeEngine
    from tests.support.fleet_fakes import METAS, fleet_config

    port = free_port()
    config = fleet_config(port, engine_id=0).replace(timeout_s=TIMEOUT_S)
    trainer = Identity(job="T", role="trainer", member=0, session="run-1",
                       expects=expectations(config, trainer_stages=1, backend="gloo"))
    host = SyncSession.host("127.0.0.1", port, trainer, members={"trainer": 1}, engine_ranks=1,
                            timeout_s=TIMEOUT_S, secret=SessionSecret(SECRET_VALUE))
    monkeypatch.setenv("MEGATRON_SYNC_SECRET", "not-the-trainers")
    try:
        host.wait_ready()
        _, error = _outcome(InferenceWeightSync, config, FakeEngine(METAS, 0, 1), num_trainer_stages=1,
                            inference_rank=0, job_id="E")
    finally:
        host.close()
    assert isinstance(error, RendezvousError) and "refused this rank: inference rank 0 of engine 0 (job 'E') " \
        "presents another session secret than session 'run-1''s" in str(error), error
