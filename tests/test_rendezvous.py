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
              model=None, session=None) -> Identity:
    return Identity(job=job, role=role, member=member, session=session,
                    expects=expectations(config, trainer_stages=stages, backend="gloo"),
                    model=model_fields(model if model is not None else hf_config(ModelSpec("qwen3"))))


def _host(port: int, config: WeightSyncConfig, *, stages: int = 1, model=None) -> SyncSession:
    me = _identity("trainer", 0, "T", config, stages=stages, model=model, session="run-1")
    return SyncSession.host("127.0.0.1", port, me, members={"trainer": 1, "inference": config.num_inference_ranks},
                            timeout_s=TIMEOUT_S)


def _join(port: int, member: int, job: str, config: WeightSyncConfig, **kw) -> SyncSession:
    session = SyncSession.join("127.0.0.1", port, _identity("inference", member, job, config, **kw),
                               timeout_s=TIMEOUT_S)
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
