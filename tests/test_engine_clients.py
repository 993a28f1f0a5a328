"""Engines driven over HTTP, without a server: rendezvous planning, settings, the vLLM wire format, the fleet."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pytest

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.engines.base import EngineClient, Rendezvous, plan_rendezvous
from megatron_sync.settings.config import parse_engine
from megatron_sync.engines.driven import EngineFleet, clients_from_config, worker_counts
from megatron_sync.engines.sglang.client import SGLangEngineClient
from megatron_sync.engines.vllm.client import PAUSE_PLANS, VLLMEngineClient
from megatron_sync.engines.vllm.wire import JoinInfo, UpdateInfo
from megatron_sync.core.errors import SyncAbortedError


@pytest.mark.parametrize("stages,counts,firsts", [
    (1, [2], [0]),
    (2, [1, 1], [0, 1]),
    (2, [4, 2, 2], [0, 4, 6]),
])
def test_engines_take_consecutive_inference_ranks(stages, counts, firsts):
    config = WeightSyncConfig(num_inference_ranks=sum(counts))
    got = plan_rendezvous(config, stages, counts, "gloo")
    assert [(r.first_inference_rank, r.num_workers) for r in got] == list(zip(firsts, counts))
    assert all(r.config.backend == "gloo" and r.num_trainer_stages == stages for r in got)
    last = got[-1]
    assert [last.worker_of(i) for i in range(sum(counts) + 1)] == [
        None] * last.first_inference_rank + list(range(last.num_workers)) + [None]


def test_worker_counts_must_add_up_to_num_inference_ranks():
    with pytest.raises(ValueError, match="set it to 3"):
        plan_rendezvous(WeightSyncConfig(num_inference_ranks=2), 1, [2, 1], "gloo")


def test_engines_setting_lists_kind_and_url_and_builds_the_clients():
    config = WeightSyncConfig(engines=["vllm=http://a:8000", "sglang=http://b:30000/"], timeout_s=7)
    clients = clients_from_config(config)
    assert [(type(c), c.url, c.timeout_s) for c in clients] == [
        (VLLMEngineClient, "http://a:8000", 7), (SGLangEngineClient, "http://b:30000", 7)]
    assert all(isinstance(c, EngineClient) for c in clients)
    assert parse_engine("vllm=https://h:1") == ("vllm", "https://h:1")
    for bad in ("http://a:8000", "trtllm=http://a", "vllm=a:8000"):
        with pytest.raises(ValueError, match="KIND=URL"):
            WeightSyncConfig(engines=[bad])
    with pytest.raises(ValueError, match="list of KIND=URL"):
        WeightSyncConfig(engines="vllm=http://a:8000")


def test_join_info_round_trips_through_json_and_is_validated():
    config = WeightSyncConfig(family="qwen3_moe", dtype="float32", num_inference_ranks=4, metrics_path="/tmp/m",
                              engines=["vllm=http://a:1"])
    rendezvous = Rendezvous(config=config, num_trainer_stages=2, first_inference_rank=2, num_workers=2)
    info = JoinInfo.of(rendezvous)
    again = JoinInfo(**info.to_json())  # what vLLM's parse_init_info does with the request's init_info
    assert again.config() == dataclasses.replace(config, metrics_path=None, engines=())
    assert (again.num_trainer_stages, again.first_inference_rank) == (2, 2)
    with pytest.raises(ValueError, match="first_inference_rank must be an integer >= 0"):
        JoinInfo(weight_sync=info.weight_sync, num_trainer_stages=2, first_inference_rank=-1)
    with pytest.raises(ValueError, match="unknown weight_sync keys"):
        JoinInfo(weight_sync={**info.weight_sync, "bucket_mb": 1}, num_trainer_stages=2, first_inference_rank=0)
    with pytest.raises(ValueError, match="version must be an integer >= 1"):
        UpdateInfo(version=0)


def test_every_inflight_policy_maps_to_a_vllm_pause_mode_and_a_cache_rule():
    from megatron_sync.settings.config import INFLIGHT_POLICIES

    assert {p: (plan.mode, plan.reset_running) for p, plan in PAUSE_PLANS.items()} == {
        "abort": ("abort", False), "wait": ("wait", False), "recompute": ("keep", True), "keep": ("keep", None)}
    assert set(PAUSE_PLANS) == set(INFLIGHT_POLICIES)


class FakeEngine:
    """An EngineClient holding what a real engine would: paused, weight version tag, open update."""

    def __init__(self, url: str, first: int) -> None:
        self.url, self.first = url, first
        self.paused, self.tag, self.open, self.closed = False, "0", False, False

    def num_workers(self) -> int:
        return 1

    def join(self, rendezvous):
        raise AssertionError("not used here")

    def before_sync(self, version: int) -> None:
        self.paused, self.open = True, True

    def begin_transfer(self, version: int) -> None:
        assert self.paused and self.open, "transfer began before the engine paused and opened the update"

    def after_sync(self, version: int, ok: bool) -> None:
        self.open = False
        if ok:
            self.tag = str(version)
        self.paused = False

    def describe_rank(self, inference_rank: int):
        return f"worker 0 of {self.url}" if inference_rank == self.first else None

    def close(self) -> None:
        self.closed = True


INFERENCE_RANKS = range(1, 3)  # one trainer stage, two inference ranks


def test_fleet_names_the_failing_worker_and_tags_only_committed_versions():
    engines = [FakeEngine("http://a", 0), FakeEngine("http://b", 1)]
    fleet = EngineFleet(engines, driven=True)
    fleet.before_sync(1)
    fleet.begin_transfer(1)
    fleet.after_sync(1, ok=True)
    assert [(e.paused, e.tag) for e in engines] == [(False, "1"), (False, "1")]
    fleet.before_sync(2)
    fleet.begin_transfer(2)
    error = fleet.named(SyncAbortedError(2, [(0, "sender fine"), (2, "commit failed: boom")]), INFERENCE_RANKS)
    assert error.failures == [(0, "sender fine"), (2, "worker 0 of http://b: commit failed: boom")]
    fleet.after_sync(2, ok=False)
    assert [(e.paused, e.open, e.tag) for e in engines] == [(False, False, "1"), (False, False, "1")]
    fleet.close()
    assert all(e.closed for e in engines) and fleet.clients == []


def test_fleet_resumes_engines_already_paused_when_another_cannot_pause():
    class Unreachable(FakeEngine):
        def before_sync(self, version):
            raise ConnectionError("engine b is down")

    engines = [FakeEngine("http://a", 0), Unreachable("http://b", 1)]
    with pytest.raises(ConnectionError):
        EngineFleet(engines, driven=True).before_sync(1)
    assert (engines[0].paused, engines[0].open, engines[0].tag) == (False, False, "0")


def test_a_fleet_asks_every_engine_for_its_workers_at_once_and_names_the_first_that_fails():
    """A vLLM server's first answer about itself takes seconds; asked one by one, a fleet waits for the sum.
    Each engine here answers only once all three were asked (a barrier): asked in turn, the first would wait
    out the barrier's timeout and the start would fail."""
    asked = threading.Barrier(3, timeout=20)

    class Slow(FakeEngine):
        def num_workers(self) -> int:
            asked.wait()
            return 2 if self.url == "http://c" else 1

        def join(self, rendezvous):
            return rendezvous

    engines = [Slow("http://a", 0), Slow("http://b", 1), Slow("http://c", 2)]
    config = WeightSyncConfig(num_inference_ranks=4)
    rendezvous = EngineFleet(engines, driven=True).start_joins(config, num_trainer_stages=1)
    assert [r.num_workers for r in rendezvous] == [1, 1, 2]

    class Down(FakeEngine):
        def num_workers(self) -> int:
            raise ConnectionError(f"{self.url} is down")

    with pytest.raises(ConnectionError, match="http://b is down"):
        worker_counts([FakeEngine("http://a", 0), Down("http://b", 1), Down("http://c", 2)])


def test_fleet_without_clients_does_nothing():
    fleet = EngineFleet([], driven=True)
    assert fleet.start_joins(WeightSyncConfig(), num_trainer_stages=1) == []
    with fleet.joined():
        pass
    error = SyncAbortedError(1, [(1, "x")])
    assert fleet.named(error, INFERENCE_RANKS) is error
    fleet.before_sync(1), fleet.begin_transfer(1), fleet.after_sync(1, ok=True), fleet.close()


def test_sglang_client_refuses_settings_sglang_cannot_honour():
    client = SGLangEngineClient("http://sglang:30000")
    client._info = {"tp_size": 1, "disable_radix_cache": False}  # what /server_info answered
    base = dict(num_inference_ranks=1, engines=["sglang=http://sglang:30000"])

    def rendezvous(**values):
        config = WeightSyncConfig(**{**base, **values})
        return Rendezvous(config=config, num_trainer_stages=1, first_inference_rank=0, num_workers=1)

    with pytest.raises(ValueError, match="set weight_sync.transport: sglang"):
        client.join(rendezvous())
    with pytest.raises(ValueError, match="no 'wait'"):
        client.join(rendezvous(transport="sglang", inflight_policy="wait"))
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        client.join(rendezvous(transport="sglang", inflight_policy="keep"))


@pytest.mark.multiproc
def test_trainer_side_modules_import_without_vllm_or_sglang():
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None\n"
            "import megatron_sync.drivers.sync, megatron_sync.engines.vllm.client, megatron_sync.drivers.vllm_plugin\n"
            "import megatron_sync.engines.sglang.client, megatron_sync.transports.sglang\n"
            "from megatron_sync.transports import get_transport; get_transport('sglang')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": root},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
