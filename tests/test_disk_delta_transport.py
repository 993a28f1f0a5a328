"""The disk-delta transport's control and numbering, in one process (threads for the inference ranks).

The endpoints are the real ones (`DiskDeltaTransport` with its directory session,
`DeltaSender` into a real `DeltaWriter`, `DeltaReceiver` with real readers);
the weights come from the seeded fake stream and go into fake TP-sharding
engines, and every check compares bytes with what the stream produced.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.wait import poll
from megatron_sync.transports.disk_delta import receiver as delta_receiver
from megatron_sync.transports.disk_delta.localcopy import open_committed
from megatron_sync.core.errors import RendezvousError
from megatron_sync.transports import get_transport
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.transports.disk_delta.transport import DiskDeltaTransport, latest_version
from tests.support.fakes import STAGES, FakeEngine, FakeStream, make_tensor, shard_rule
from tests.support.timing import scaled

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path, **extra) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({
        "transport": "disk_delta", "family": "qwen3", "num_inference_ranks": 2, "engine_tp_size": 2,
        "timeout_s": 20.0, "delta_dir": str(tmp_path / "shared"), "delta_local_dir": str(tmp_path / "host0"),
        "delta_snapshot_every": 3, "delta_retention": 2, "delta_encode_threads": 1, **extra})


class _Run:
    """One trainer run (a stage source per stage) and two inference ranks, each inference rank on its own thread."""

    def __init__(self, config: WeightSyncConfig, stages: int = 1, inference_stages: Optional[int] = -1) -> None:
        """`inference_stages`: the trainer stages the inference ranks are told (-1: `stages`; None: none)."""
        self.config, self.metas = config, [m for stage in STAGES[:stages] for m in stage]
        pool = ThreadPoolExecutor(3)
        told = stages if inference_stages == -1 else inference_stages
        inference = [pool.submit(self._connect_inference, r, told) for r in range(2)]
        layouts = [SimpleNamespace(pp_rank=s, pp=stages, is_stage_source=True) for s in range(stages)]
        self.sources = [DiskDeltaTransport.connect_trainer(config, layout) for layout in reversed(layouts)][::-1]
        self.trainer = self.sources[0]  # the leader
        self.streams = [FakeStream(s, STAGES[s]) for s in range(stages)]
        self.senders = [DiskDeltaTransport.make_sender(t, st, config, ()) for t, st in zip(self.sources, self.streams)]
        self.ranks = [f.result(timeout=30) for f in inference]
        self.pool = pool

    def _connect_inference(self, rank: int, stages: Optional[int]):
        transport = DiskDeltaTransport.connect_inference(self.config, num_trainer_stages=stages, inference_rank=rank)
        return transport, FakeEngine(self.metas, rank, 2)

    def make_receivers(self) -> None:
        futures = [self.pool.submit(t.make_receiver, e, self.config, ()) for t, e in self.ranks]
        self.receivers = [f.result(timeout=30) for f in futures]

    def sync(self, version: int, stream_version: int) -> None:
        """The driver's trainer side: announce, then submit on every stage (writers publish in the background)."""
        self.trainer.control.send(ControlMessage(ControlOp.SYNC, version))
        for stream, sender in zip(self.streams, self.senders):
            stream.version = stream_version
            sender.sync(version)

    def serve_one(self) -> list:
        """The driver's inference side for one message, on both ranks; return their metrics."""
        def one(index: int):
            transport, _ = self.ranks[index]
            message = transport.control.next(30)
            metrics = self.receivers[index].receive(message.version)
            transport.control.report(Report.METRICS, message.version, transport.rank, metrics.to_json().encode())
            return metrics

        return [f.result(timeout=60) for f in [self.pool.submit(one, i) for i in range(2)]]

    def close(self) -> None:
        for transport, _ in self.ranks:
            transport.close()
        for source in self.sources:
            source.close()
        self.pool.shutdown()


def _assert_holds(run: _Run, version: int, stream_version: int) -> None:
    for stage, metas in enumerate(STAGES[:len(run.sources)]):
        held, tensors = open_committed(os.path.join(run.config.delta_local_dir, f"stage-{stage}"))
        assert held == version
        for meta in metas:
            assert torch.equal(tensors[meta.name].view(torch.uint8), make_tensor(meta, stream_version).view(torch.uint8))
    for tp_rank, (_, engine) in enumerate(run.ranks):
        assert engine.version == version
        for meta in run.metas:
            assert torch.equal(engine.weights[meta.name], shard_rule(meta, make_tensor(meta, stream_version), tp_rank, 2))


def test_the_registry_builds_it_and_the_config_requires_its_directories(tmp_path):
    assert get_transport("disk_delta") is DiskDeltaTransport
    with pytest.raises(ValueError, match="transport='disk_delta' needs delta_dir"):
        WeightSyncConfig(transport="disk_delta")
    with pytest.raises(ValueError, match="delta_when_behind must be one of"):
        _config(tmp_path, delta_when_behind="drop")
    with pytest.raises(ValueError, match="delta_retention must be an integer >= 1"):
        _config(tmp_path, delta_retention=0)


def test_versions_arrive_and_a_restarted_trainer_numbers_above_the_store(tmp_path):
    config = _config(tmp_path)
    run = _Run(config)
    run.make_receivers()
    for version in (1, 2, 3):
        run.sync(version, stream_version=version)
        metrics = run.serve_one()
        _assert_holds(run, version, version)
        assert metrics[0].bytes > 0 and metrics[1].bytes == 0  # rank 0 applies for the host, rank 1 reads its file
    reports = run.trainer.control.collect(Report.METRICS, 3, run.trainer.inference_ranks)
    assert sorted(reports) == [1, 2]
    run.close()
    assert latest_version(config.delta_dir) == 3

    # A new trainer run on the same store: its first sync is store version 4, and engines hold 4.
    again = _Run(config)
    assert again.trainer.version_offset == 3
    again.make_receivers()
    again.sync(1, stream_version=10)
    (metrics, _) = again.serve_one()
    assert metrics.version == 1  # the driver's numbering in the report ...
    _assert_holds(again, 4, 10)  # ... the store's on the engines and in the local copy
    again.close()


def test_sync_means_the_newest_published_version_and_a_held_one_is_a_no_op(tmp_path):
    run = _Run(_config(tmp_path))
    run.make_receivers()
    run.sync(1, stream_version=1)
    run.sync(2, stream_version=2)
    run.trainer.writer.flush(timeout=30)
    first = run.serve_one()  # "sync 1" finds 2 published already: it applies 2
    _assert_holds(run, 2, 2)
    second = run.serve_one()  # "sync 2": every rank holds it
    _assert_holds(run, 2, 2)
    assert first[0].bytes > 0 and second[0].bytes == 0 and second[0].phases["apply"] == 0
    run.close()


def _looks_finding(version: int, monkeypatch) -> collections.Counter:
    """Return a counter, per thread, of the receivers' looks at a stage's store that found `version` published
    there (the real look runs; a receiver looks at every stage's store once per round of its wait)."""
    real, looks = delta_receiver.published_versions, collections.Counter()

    def published_versions(store: str) -> list[int]:
        versions = real(store)
        if version in versions:
            looks[threading.get_ident()] += 1
        return versions

    monkeypatch.setattr(delta_receiver, "published_versions", published_versions)
    return looks


def test_an_inference_job_with_other_settings_is_refused_by_the_handshake_every_transport_passes(tmp_path):
    """The directory session compares what the rendezvous store compares: here the dtype (and the stages the
    inference job assumes); the trainer's leader fails too, quoting the refusal."""
    trainer_config, inference_config = _config(tmp_path), _config(tmp_path, dtype="float16", num_inference_ranks=1,
                                                                    engine_tp_size=1)
    layout = SimpleNamespace(pp_rank=0, pp=1, is_stage_source=True)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(DiskDeltaTransport.connect_inference, inference_config, num_trainer_stages=2,
                              inference_rank=0)
        with pytest.raises(RendezvousError, match=r"expects 2 inference ranks, this inference job has 1.*engines "
                                                  r"of 2 ranks .*, this inference job has 1.*sends dtype 'bfloat16', this inference job computes in 'float16'"):
            DiskDeltaTransport.connect_trainer(trainer_config, layout)
        with pytest.raises(RendezvousError, match="refused this rank: .*has 1 pipeline stages, this inference job "
                                                  "expects 2"):
            joining.result(timeout=20)


def test_the_drivers_present_their_models_and_an_engine_serving_another_model_is_refused(tmp_path):
    """What the two drivers present at the directory session (`files_presentation`, `InferenceWeightSync`'s
    identity) carries their HF configs' model fields, as at the rendezvous store."""
    from megatron_sync.drivers.inference_sync import _identity
    from megatron_sync.drivers.trainer_start import files_presentation
    from megatron_sync.session.files import presenting
    from tests.support.models import ModelSpec, hf_config

    config = _config(tmp_path, num_inference_ranks=1, engine_tp_size=1)
    layout = SimpleNamespace(pp_rank=0, pp=1, is_stage_source=True)
    trainer_model = hf_config(ModelSpec("qwen3"))
    engine_model = hf_config(ModelSpec("qwen3")).to_dict()
    engine_model["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    trainer = files_presentation(config, layout, DiskDeltaTransport, trainer_model, None)
    engine = presenting(_identity(config, DiskDeltaTransport, "engine-job", 0, None, "gloo", engine_model),
                        timeout_s=config.timeout_s)
    assert trainer.identity.model and "backend" not in trainer.identity.expects
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(DiskDeltaTransport.connect_inference, config, num_trainer_stages=None,
                              inference_rank=0, session=engine)
        with pytest.raises(RendezvousError, match=r"the models differ in rope_parameters.rope_theta: trainer "
                                                  r"10000.0, this inference job 1000000.0"):
            DiskDeltaTransport.connect_trainer(config, layout, session=trainer)
        with pytest.raises(RendezvousError, match="directory session in .* refused this rank: .*models differ"):
            joining.result(timeout=20)


def test_an_inference_job_that_leaves_out_the_trainer_stages_takes_them_from_the_session(tmp_path):
    run = _Run(_config(tmp_path), stages=2, inference_stages=None)
    assert [transport.num_stages for transport, _ in run.ranks] == [2, 2]
    run.make_receivers()
    run.sync(1, stream_version=1)
    run.serve_one()
    _assert_holds(run, 1, 1)
    run.close()


def test_two_pipeline_stages_publish_apart_and_engines_apply_only_versions_both_hold(tmp_path, monkeypatch):
    run = _Run(_config(tmp_path), stages=2)
    run.make_receivers()
    for version in (1, 2):
        run.sync(version, stream_version=version)
        run.serve_one()
        _assert_holds(run, version, version)
    with pytest.raises(RuntimeError, match="only the leader"):
        run.sources[1].control.send(ControlMessage(ControlOp.SYNC, 3))
    # Stage 1 runs behind: "sync 3" waits until both stages hold version 3.
    run.trainer.control.send(ControlMessage(ControlOp.SYNC, 3))
    run.streams[0].version = 3
    run.senders[0].sync(3)
    looks = _looks_finding(3, monkeypatch)
    serving = run.pool.submit(run.serve_one)
    # the applier found 3 in stage 0's store (only there) in two rounds: after the first it chose to wait
    poll(lambda: max(looks.values(), default=0) >= 2 or serving.done(), within=scaled(30),
         what="the applier finding version 3 in stage 0's store twice")
    assert max(looks.values()) >= 2 and not serving.done() and run.ranks[0][1].version == 2
    run.streams[1].version = 3
    run.senders[1].sync(3)
    serving.result(timeout=60)
    _assert_holds(run, 3, 3)
    run.close()
