"""The disk-delta transport through the unchanged drivers: real Megatron Adam steps, through shared storage.

A tiny Qwen3 is trained by megatron-core on CPU (Adam, learning rate 1e-5, an
RL-sized step) and synced after every step with `TrainerWeightSync` and
`transport: disk_delta`, in bf16; a separately spawned inference job of one
engine (TP=2) follows with `InferenceWeightSync`. The two jobs share only a
directory: versions, control messages, reports and the engines' agreement
rounds are files in it (no TCP rendezvous; `master_port` is never opened).

After every version, checked outside the jobs: the host's local copy (the
memory-mapped safetensors file the applier patched) equals, bit for bit, what
the trainer's own weight stream produces for that version; every engine
rank's shards equal their slice of it; and the engine's logits equal the
trainer's Megatron forward. Logits tolerance: the engine's bf16 weights are
evaluated in float32 (a float32 copy of the same TP engine) and the trainer
runs its forward with its weights rounded to bf16, so both compute the same
function of the same weights with different kernels (observed <= 3e-6,
ATOL 5e-5); negative control: the previous version's logits are >= 20 x ATOL
away (one Adam step at 1e-5 moves them by ~5e-3 here).

Fault through the drivers: a data file of one version is damaged in the store
before the engines read it. They refuse that version on every rank (the error
names the file), stay on the previous one, ask the writer for a snapshot, and
apply the next version, which carries it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron_sync.core.wait import poll
from tests.support.jobs import EVAL_TOKENS, run_pair, sync_config
from tests.support.fakes import shard_of
from tests.support.timing import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = 5e-5
VERSIONS = 12  # version 1 = the initial weights, then 11 optimizer steps
LR = 1e-5


def _case(tmp_path, versions: int, **extra) -> dict:
    return {"spec": {"family": "qwen3"}, "versions": versions, "timeout_s": 120.0, **extra,
            "weight_sync": {"transport": "disk_delta", "dtype": "bfloat16", "delta_dir": str(tmp_path / "shared"),
                            "delta_local_dir": str(tmp_path / "host0"), "delta_snapshot_every": 5,
                            "delta_retention": 2, "delta_when_behind": "block", "delta_encode_threads": 1}}


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Wait until `predicate()` is true; WaitTimeout (a TimeoutError) naming `what` after `timeout_s`, scaled."""
    poll(predicate, within=scaled(timeout_s), what=what)


def delta_trainer_job(rank: int, world_size: int, case: dict) -> dict:
    """Train and sync every version in lockstep with the engines; return what the stream produced per version."""
    from megatron_sync.drivers.sync import TrainerWeightSync
    from megatron_sync.core.grid import ParallelLayout
    from tests.delta_support import bf16_rounded
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron(seed=3)
    spec = models.ModelSpec(**case["spec"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    layout = ParallelLayout.from_megatron()
    ddp = wrap_in_ddp(chunks)
    optimizer = make_optimizer(ddp, lr=LR)
    config = sync_config(case)
    requests = os.path.join(config.delta_dir, "stage-0", "requests")
    syncer = TrainerWeightSync(config, ddp, hf_config=models.hf_config(spec), layout=layout)
    rows = []
    try:
        for version in range(1, case["versions"] + 1):
            if version > 1:
                tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(version))
                train_step(ddp, optimizer, tokens, layout)
            submitted = syncer.sync()
            # The reference: a second walk of the library's own stream (the weights did not move since).
            sent = {name: tensor.clone() for name, tensor in syncer.stream}
            with bf16_rounded(chunks):
                logits = models.megatron_logits(chunks, EVAL_TOKENS)
            if version == case.get("damage_version"):
                # The engines refuse it; what they leave behind is the snapshot request.
                _wait_for(lambda: os.path.isdir(requests) and os.listdir(requests), "a snapshot request")
                received = []
            else:
                received = [m.to_json() for m in syncer.receiver_metrics(version)]
            rows.append({"sent": sent, "logits": logits, "submitted": submitted.to_json(), "received": received})
    finally:
        syncer.close()
    published = [m.to_json() for m in syncer.sender.published]
    stats = [(s.version, s.raw_bytes, s.delta_bytes, s.snapshot_bytes) for s in syncer.sender.publish_stats]
    return {"rows": rows, "published": published, "stats": stats}


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _damage(config, version: int) -> str:
    """Flip one byte in the middle of `version`'s delta file in stage 0's store; return its path."""
    from megatron_sync.transports.disk_delta.storedir import version_path

    path = os.path.join(version_path(os.path.join(config.delta_dir, "stage-0"), version), "delta-00000.bin")
    _wait_for(lambda: os.path.exists(path), f"version {version} being published")
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0x40]))
    return path


def delta_engine_job(rank: int, world_size: int, case: dict) -> dict:
    """Serve until "stop"; after each sync record the engine's version, shards, float32 logits, local copy."""
    from megatron_sync.transports.disk_delta.localcopy import open_committed
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.drivers.serve import join
    from megatron_sync.drivers.sync import InferenceWeightSync
    from megatron_sync.session.control import ControlOp
    from tests.support import models

    config = sync_config(case)
    hf = models.hf_config(models.ModelSpec(**case["spec"]))
    me = join(config, hf)
    evaluator = ReferenceEngine(hf, tp_rank=me.tp_rank, tp_size=config.engine_tp_size, group=me.group,
                                dtype=torch.float32)
    errors = _Errors()
    logging.getLogger("megatron_sync").addHandler(errors)
    isync = InferenceWeightSync(config, me.engine, inference_rank=me.rank, engine_group=me.group)  # stages: adopted
    held, damaged = [], None
    try:
        while True:
            message = isync.next_control(timeout_s=120)
            if message.op is ControlOp.SYNC and message.version == case.get("damage_version") and rank == 0:
                damaged = _damage(config, message.version)
            if not isync.handle(message, {}):
                break
            shards = me.engine.snapshot()
            evaluator.load_shards({name: shard.float() for name, shard in shards.items()}, me.engine.version)
            local = None
            if rank == 0:  # the host's applier: its committed local copy
                version, tensors = open_committed(os.path.join(config.delta_local_dir, "stage-0"))
                local = {"version": version, "tensors": {n: t.clone() for n, t in tensors.items()}}
            held.append({"message": message.version, "version": me.engine.version, "shards": shards,
                         "logits": evaluator.logits(EVAL_TOKENS), "local": local})
    finally:
        isync.close()
    return {"held": held, "errors": errors.messages, "damaged": damaged}


def _assert_version_arrived(engines, sent, logits, previous_logits, version: int, index: int) -> None:
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.models import ModelSpec, hf_config

    local = engines[0]["held"][index]["local"]
    assert local["version"] == version
    assert local["tensors"].keys() == sent.keys()
    for name, tensor in sent.items():
        assert torch.equal(local["tensors"][name].view(torch.uint8), tensor.view(torch.uint8)), (version, name)
    for tp_rank, engine in enumerate(engines):
        record = engine["held"][index]
        assert record["version"] == version
        slicer = ReferenceEngine(hf_config(ModelSpec("qwen3")), tp_rank=tp_rank, tp_size=2, dtype=torch.bfloat16)
        for name, shard in record["shards"].items():
            assert torch.equal(shard, shard_of(slicer, name, sent[name])), (version, tp_rank, name)
        assert float((record["logits"] - logits).abs().max()) < ATOL, version
        if previous_logits is not None:
            assert float((record["logits"] - previous_logits).abs().max()) > 20 * ATOL, version


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_chain_of_real_adam_steps_arrives_bit_for_bit_through_the_drivers(tmp_path):
    trainer, engines = run_pair(_case(tmp_path, VERSIONS), timeout=500, trainer=delta_trainer_job,
                                engine=delta_engine_job)
    rows = trainer[0]["rows"]
    assert [h["message"] for h in engines[0]["held"]] == list(range(1, VERSIONS + 1))
    for index, row in enumerate(rows):
        previous = rows[index - 1]["logits"] if index else None
        _assert_version_arrived(engines, row["sent"], row["logits"], previous, index + 1, index)
    assert not engines[0]["errors"] and not engines[1]["errors"]
    # Deltas, not full copies: every version after the first is a fraction of the raw bytes.
    stats = trainer[0]["stats"]
    assert [s[0] for s in stats] == list(range(1, VERSIONS + 1))
    assert all(delta < 0.5 * raw for _, raw, delta, _ in stats[1:])
    assert [v for v, _, _, snap in stats if snap] == [1, 6, 11]  # delta_snapshot_every=5
    assert len(trainer[0]["published"]) == VERSIONS
    _print_table(trainer[0], stats)


def _print_table(trainer: dict, stats: list) -> None:
    """Print (pytest -s) every version's submission, publication and receive rows, and the payload sizes."""
    from megatron_sync.core.metrics import SyncMetrics, format_table

    rows = []
    for row, published in zip(trainer["rows"], trainer["published"]):
        rows += [SyncMetrics.from_json(row["submitted"]), SyncMetrics.from_json(published)]
        rows += [SyncMetrics.from_json(r) for r in row["received"]]
    print("\n" + format_table(rows))
    print("version raw_KB delta_KB snapshot_KB: " + "; ".join(
        f"{v} {raw / 1024:.0f} {delta / 1024:.0f} {snap / 1024:.0f}" for v, raw, delta, snap in stats))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_damaged_file_is_refused_by_every_engine_rank_and_the_next_version_heals(tmp_path):
    damaged_version, versions = 3, 4
    case = _case(tmp_path, versions, damage_version=damaged_version)
    trainer, engines = run_pair(case, timeout=400, trainer=delta_trainer_job, engine=delta_engine_job)
    rows, path = trainer[0]["rows"], engines[0]["damaged"]
    assert path and path.endswith(os.path.join("v00000003", "delta-00000.bin"))
    for rank, engine in enumerate(engines):
        assert [h["message"] for h in engine["held"]] == [1, 2, 3, 4]
        assert [h["version"] for h in engine["held"]] == [1, 2, 2, 4]  # refused 3, healed at 4
        assert any(path in m and "does not match its digest" in m for m in engine["errors"]), engine["errors"]
    # While refused, everything is still version 2, bit for bit; version 4 arrives whole (from its snapshot).
    _assert_version_arrived(engines, rows[1]["sent"], rows[1]["logits"], None, 2, 2)
    _assert_version_arrived(engines, rows[3]["sent"], rows[3]["logits"], rows[2]["logits"], 4, 3)
    assert [s[0] for s in trainer[0]["stats"] if s[3]] == [1, 4]  # the reader's request made 4 a snapshot


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_the_demo_jobs_sync_over_shared_storage_while_the_engine_generates(tmp_path):
    """The demo's two torchrun jobs (Qwen3-MoE, trainer EP=2, engine TP=2), unchanged, on transport disk_delta:
    every version's engine logits match the trainer's, and rollouts in flight switch versions at a step boundary
    (policy recompute) while the version is patched in behind them."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--config", "configs/demo_qwen3_moe_ep2.yaml", "--time-limit", "300",
         "--weight-sync-transport", "disk_delta", "--weight-sync-disk-delta-dir", str(tmp_path / "shared"),
         "--weight-sync-disk-delta-local-dir", str(tmp_path / "host0")],
        cwd=ROOT, capture_output=True, text=True, timeout=scaled(360))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "4 versions synced; all checks passed" in done.stdout
    rollouts = [line for line in done.stdout.splitlines() if "rollout started on version" in line]
    assert len(rollouts) == 6 and all(line.endswith("(ok)") for line in rollouts), rollouts
    assert sorted(os.listdir(tmp_path / "shared")) == ["control", "stage-0"]
