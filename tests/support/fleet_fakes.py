"""A fleet of fake engines against one fake trainer, each in its own process, for tests/test_fleet.py.

The trainer is a `FleetDriver` over a seeded `FakeStream` (one stage); every engine is a separately started
process running `InferenceWeightSync.serve` around a `FakeEngine` of one rank, which checks each version it
commits against the reference tensors bit for bit and reports it. The test drives the script: it starts and
kills processes between syncs (the trainer waits for its go-ahead before each version) and reads the reports.
"""

from __future__ import annotations

import os
import queue
import uuid
from typing import Any, Optional

import torch

from megatron_sync.convert import get_family, keep_together_of
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.wait import Deadline
from megatron_sync.layout.rank import RankLayout
from megatron_sync.core.meta import TensorMeta
from tests.support.fakes import STAGES, FakeEngine, FakeStream, FaultyLayout, make_tensor, shard_rule
from tests.support.fleet_jobs import await_admitted
from tests.support.timing import scaled

METAS: list[TensorMeta] = [m for stage in STAGES for m in stage]
FAMILY = "deepseek_v3"
STEP_TIMEOUT_S = 120.0  # how long a process waits for the test's next step, scaled (the test itself is bounded)


def fleet_config(port: int, **changes: Any) -> WeightSyncConfig:
    return WeightSyncConfig(fleet=True, num_inference_ranks=3, engine_tp_size=1, family=FAMILY, master_port=port,
                            timeout_s=20.0, bucket_size_mb=2048 / 2**20, checksum="xxh3", dtype="float32", **changes)


def keep_together() -> Any:
    return keep_together_of(get_family(FAMILY), [m.name for m in METAS])


def model_bytes() -> int:
    return sum(make_tensor(m, 1).numel() * make_tensor(m, 1).element_size() for m in METAS)


class CheckedEngine(FakeEngine):
    """A fake engine of one rank that reports every commit (exact or not) and can die mid-sync or mid-relay."""

    def __init__(self, engine_id: int, reports: Any, *, die_at: Optional[int] = None) -> None:
        super().__init__(METAS, 0, 1)
        self.engine_id, self.reports, self.die_at = engine_id, reports, die_at
        self._faulty = FaultyLayout.wrap(self._layout, self._before_write)
        self._written: dict[int, int] = {}

    def rank_layout(self) -> RankLayout:
        return self._faulty

    def _before_write(self, n: int) -> None:
        version = self.version + 1
        self._written[version] = self._written.get(version, 0) + 1
        if version == self.die_at and self._written[version] > 2:
            os._exit(17)  # killed a few tensors into the version

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        super().load_shards(shards, version)
        exact = all(torch.equal(shards[m.name].contiguous().view(-1).view(torch.uint8),
                                shard_rule(m, make_tensor(m, version), 0, 1).contiguous().view(-1).view(torch.uint8))
                    for m in METAS)
        self.reports.put(("commit", self.engine_id, version, exact))


def trainer_main(port: int, changes: dict, versions: list[int], go: Any, reports: Any) -> None:
    """One trainer rank hosting the session; syncs each version once the test says go."""
    from megatron_sync.fleet.trainer import FleetDriver
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.transports.broadcast import BroadcastTransport
    from megatron_sync.session.rendezvous import Identity, expectations
    from megatron_sync.session.session import SyncSession

    config = fleet_config(port, **changes)
    identity = Identity(job="trainer-fake", role="trainer", member=0,
                        expects=expectations(config, trainer_stages=1, backend="gloo",
                                             shares=BroadcastTransport.shares))
    session = SyncSession.host("127.0.0.1", port, identity, members={"trainer": 1}, timeout_s=config.timeout_s,
                               engine_ranks=config.engine_tp_size)
    stream = FakeStream(0, METAS)
    driver = None
    try:
        session.wait_ready()
        driver = FleetDriver(config, ParallelLayout(), session=session, transport_cls=BroadcastTransport,
                             stream=stream, keep_together=keep_together(), gather=lambda value: [value])
        driver.start()
        reports.put(("started", sorted(driver.links)))
        for version in versions:
            step, admitted = go.get(timeout=scaled(STEP_TIMEOUT_S))
            assert step == version, (step, version)
            await_admitted(session, admitted, STEP_TIMEOUT_S)  # engines the test started join before the sync
            stream.version = version
            metrics = driver.sync(version)
            reports.put(("synced", version, metrics.fleet, metrics.staleness, sorted(driver.links)))
    except BaseException as e:  # noqa: BLE001 — the test reads it
        reports.put(("trainer-error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        if driver is not None:
            driver.close()
        session.close()
        reports.put(("trainer-exit",))


def engine_main(port: int, changes: dict, engine_id: int, reports: Any, die_at: Optional[int] = None,
                relay_dies_at: Optional[int] = None) -> None:
    """One engine job of one rank: serve until "stop"; report every commit and how it left."""
    from megatron_sync.drivers.sync import InferenceWeightSync

    if relay_dies_at is not None:
        _die_when_relaying(relay_dies_at)
    config = fleet_config(port, **changes).replace(engine_id=engine_id)
    engine = CheckedEngine(engine_id, reports, die_at=die_at)
    isync = None
    try:
        isync = InferenceWeightSync(config, engine, num_trainer_stages=1, inference_rank=0,
                                    job_id=f"engine{engine_id}-{uuid.uuid4().hex[:6]}")
        reports.put(("joined", engine_id, isync.session.generation))
        isync.serve()
        windows = [(m.version, m.started_at, m.ended_at) for m in isync.receiver.history]
        reports.put(("engine-exit", engine_id, engine.version, "stopped", windows))
    except BaseException as e:  # noqa: BLE001 — the test reads it
        reports.put(("engine-exit", engine_id, engine.version, f"{type(e).__name__}: {e}"))
    finally:
        if isync is not None:
            isync.close()


def _die_when_relaying(version: int) -> None:
    """Fault injection: this engine's process exits once a relay of `version` began (the handshake with the
    destination done, no byte of the set sent yet)."""
    from megatron_sync.fleet import engine as fleet_engine
    from megatron_sync.fleet import relay

    real = fleet_engine.send_live_set

    def dying(part, *, ranks, rank, live, layout, algorithm, backend, timeout_s):
        if live is not None and live[0] == version:
            group = relay._group(part, ranks, rank, backend, timeout_s)
            group.all_gather_json({"layout": layout, "version": live[0], "nbytes": live[1].numel()})
            os._exit(17)
        return real(part, ranks=ranks, rank=rank, live=live, layout=layout, algorithm=algorithm, backend=backend,
                    timeout_s=timeout_s)

    fleet_engine.send_live_set = dying


def drain(reports: Any, until: Any, timeout: float = STEP_TIMEOUT_S) -> list[tuple]:
    """Read reports until one satisfies `until(report)` (returned last); AssertionError after `timeout`
    (scaled for load)."""
    seen, limit = [], Deadline.after(scaled(timeout))
    while not limit.expired():
        try:
            report = reports.get(timeout=limit.remaining(floor=0.01))
        except queue.Empty:
            break
        seen.append(report)
        if report[0] == "trainer-error":
            raise AssertionError(f"the trainer failed: {report[1]}; reports so far: {seen}")
        if until(report):
            return seen
    raise AssertionError(f"no matching report within {scaled(timeout):g}s; reports so far: {seen}")



def drain_while(reports: Any, wanting: Any, timeout: float = STEP_TIMEOUT_S) -> list[tuple]:
    """Read reports while `wanting(read so far)` is true, up to the scaled bound; return what was read (it
    never raises: the caller's assertion says what is missing)."""
    got: list[tuple] = []
    limit = Deadline.after(scaled(timeout))
    while wanting(got) and not limit.expired():
        try:
            got.append(reports.get(timeout=min(limit.remaining(floor=0.01), 1.0)))
        except queue.Empty:
            continue
    return got
