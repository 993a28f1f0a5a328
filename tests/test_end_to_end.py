"""Tier 3: the real jobs end to end — a Megatron trainer and separately launched engines.

Each case runs the demo command (two torchrun jobs that meet only at the
weight-sync rendezvous) on a config from configs/, with the trainer and the
engines dumping what they sent and what they hold after every sync. Then,
independently of the jobs: every engine shard equals the slice of the sent
tensor that the engine's own TP layout calls for, bit for bit; versions go
1, 2, 3 ...; the weights really changed between versions. The jobs
themselves check engine logits against the trainer's Megatron forward after
every sync and exit non-zero on a mismatch.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.support.dist import free_port
from tests.support.fakes import shard_of
from tests.support.timing import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_job(tmp_path, config: str, **verify) -> tuple[str, dict]:
    with open(os.path.join(ROOT, "configs", config)) as f:
        job = yaml.safe_load(f)
    job.setdefault("verify", {}).update(dump_dir=str(tmp_path / "dumps"), **verify)
    if job.get("train", {}).get("tensorboard_dir"):
        job["train"]["tensorboard_dir"] = str(tmp_path / "tensorboard")
    job["weight_sync"]["metrics_path"] = str(tmp_path / "metrics.jsonl")
    job["weight_sync"]["master_port"] = free_port()  # the demo uses the file's port as written
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path), job


def _run_demo(path: str, *extra: str, time_limit: int = 240) -> subprocess.CompletedProcess:
    """Run the demo's two jobs; the demo stops them after `time_limit` seconds (scaled for load) and fails."""
    time_limit = int(scaled(time_limit))
    return subprocess.run(
        [sys.executable, "-m", "examples.demo", "--config", path, "--time-limit", str(time_limit), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=time_limit + 60,
    )


def _tensorboard_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Return every scalar series the event files in `folder` hold: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _engine_slicer(job: dict, tp_rank: int):
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.core.meta import dtype_from_name
    from tests.support.models import ModelSpec, hf_config

    ws = job["weight_sync"]
    return ReferenceEngine(hf_config(ModelSpec(**job["model"])), tp_rank=tp_rank, tp_size=ws["engine_tp_size"],
                           group=None, dtype=dtype_from_name(ws.get("dtype", "bfloat16")))


def _sent(folder: str) -> dict[str, torch.Tensor]:
    sent: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "sent_stage*.pt"))):
        stage = torch.load(path)
        for name in set(stage) & set(sent):  # P2P spreads a large tensor's pieces over ranks holding it whole
            assert torch.equal(stage[name], sent[name]), f"two trainer ranks sent different {name}"
        sent.update(stage)
    return sent


CASES = [
    pytest.param("demo_qwen3_moe_ep2.yaml", (), id="qwen3_moe-ep2-to-engine-tp2"),
    pytest.param("e2e_qwen3_tp2_to_2x_tp1.yaml", (), id="qwen3-tp2-to-2-engines-tp1"),
    pytest.param("e2e_qwen3_moe_pp2_vpp2.yaml", (), id="qwen3_moe-pp2-vpp2-to-engine-tp2"),
    pytest.param("e2e_deepseek_v3_ep2.yaml", (), id="deepseek_v3-ep2-to-engine-tp2"),
    pytest.param("e2e_deepseek_v3_ep2_bf16.yaml", (), id="deepseek_v3-ep2-to-engine-tp2-bf16-mixed-dtype-buckets"),
    # every trainer rank dumps its own share of the distributed replica; together they are the checkpoint
    pytest.param("e2e_qwen3_tp2_to_2x_tp1.yaml", ("--weight-sync-transport", "p2p"), id="p2p-qwen3-tp2-to-2-engines-tp1"),
    # colocated: the two jobs on one host hand every bucket over in shared memory
    pytest.param("e2e_qwen3_tp2_to_2x_tp1.yaml", ("--weight-sync-transport", "ipc"), id="ipc-qwen3-tp2-to-2-engines-tp1"),
    pytest.param("demo_qwen3_moe_ep2.yaml", ("--weight-sync-transport", "ipc"), id="ipc-qwen3_moe-ep2-to-engine-tp2"),
]


@pytest.mark.e2e
@pytest.mark.timeout(360)
@pytest.mark.parametrize("config,flags", CASES)
def test_every_sync_lands_exactly_on_every_engine_rank(tmp_path, config, flags):
    path, job = _write_job(tmp_path, config)
    done = _run_demo(path, *flags)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all checks passed" in done.stdout

    if job["weight_sync"].get("dtype") == "bfloat16":
        sent = _sent(str(tmp_path / "dumps" / "v1"))
        assert {t.dtype for t in sent.values()} == {torch.bfloat16, torch.float32}  # fp32 router parts

    ws = job["weight_sync"]
    versions = job["train"].get("steps", 3) + 1  # version 1 before training, then one per step
    engines = ws["num_inference_ranks"] // ws["engine_tp_size"]
    slicers = [_engine_slicer(job, r) for r in range(ws["engine_tp_size"])]
    previous = None
    for version in range(1, versions + 1):
        folder = str(tmp_path / "dumps" / f"v{version}")
        sent = _sent(folder)
        expected = {m.name for m in slicers[0].expected_tensors()}
        assert set(sent) == expected
        for engine in range(engines):
            for tp_rank, slicer in enumerate(slicers):
                held = torch.load(os.path.join(folder, f"engine{engine}_rank{tp_rank}.pt"))
                assert held["version"] == version
                assert set(held["shards"]) == expected
                for name, shard in held["shards"].items():
                    assert torch.equal(shard, shard_of(slicer, name, sent[name])), (version, engine, tp_rank, name)
        if previous is not None:
            changed = [n for n in sent if not torch.equal(sent[n], previous[n])]
            assert changed, f"version {version} sent the same weights as version {version - 1}"
        previous = sent

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= versions  # one line per sync and rank
    if job["train"].get("tensorboard_dir"):  # the demo's figures, read back from TensorBoard's event files
        scalars = _tensorboard_scalars(str(tmp_path / "tensorboard"))
        assert [value for _, value in scalars["weight_sync/version"]] == list(range(1, versions + 1))
        assert len(scalars["weight_sync/seconds/total"]) == versions and scalars["weight_sync/bytes"][0][1] > 0
    if "ipc" in flags:  # every bucket through shared memory; only control messages over the store's socket
        rows = [row for row in map(json.loads, lines) if row["rank"] >= 0]  # trainer ranks that send nothing: -1
        assert {r["role"] for r in rows} == {"sender", "receiver"}
        for r in rows:
            assert r["media_bytes"]["shm"] == r["bytes"] > 0, r
            assert r["media_bytes"]["socket"] < 200 * r["num_buckets"] + 2000, r


@pytest.mark.e2e
@pytest.mark.timeout(360)
@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_engine_rank_dying_mid_sync_fails_the_trainer_and_leaves_survivors_on_the_previous_version(tmp_path, transport):
    from megatron_sync.transports.ipc.segments import leftover_segments

    timeout_s = 10
    path, job = _write_job(tmp_path, "demo_qwen3_moe_ep2.yaml")
    run_id = f"e2e-{os.urandom(4).hex()}"  # the session's id: its segments, not other tests' running meanwhile
    # the trainer names the failure instead of hanging: the run ends long before its own time limit
    done = _run_demo(path, "--weight-sync-timeout-s", str(timeout_s), "--test-exit-during-version", "2",
                     "--weight-sync-transport", transport, "--weight-sync-run-id", run_id, time_limit=120 + timeout_s)
    output = done.stdout + done.stderr
    assert leftover_segments(run_id) == [] and f"session {run_id}" in output, "a shared-memory segment outlived the run"
    assert done.returncode != 0
    assert "fault injection: exiting while receiving version 2" in output
    # The trainer names the failure and the transport ranks it expected, instead of hanging.
    assert "weight sync of version 2 failed" in output and "PeerFailureError" in output, output[-6000:]

    survivor = torch.load(tmp_path / "dumps" / "survivor_engine0_rank0.pt")
    assert survivor["version"] == 1
    before = torch.load(tmp_path / "dumps" / "v1" / "engine0_rank0.pt")
    assert set(survivor["shards"]) == set(before["shards"])
    for name, shard in survivor["shards"].items():
        assert torch.equal(shard, before["shards"][name]), name


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["abort", "keep"])
def test_generation_in_flight_records_the_versions_it_used(tmp_path, policy):
    # The engines take each new version in mid-generation (after 4 tokens); the trainer checks every
    # response's weight_versions / kv_versions spans for the policy and fails the job otherwise.
    # (recompute runs in the demo case above.)
    path, _ = _write_job(tmp_path, "e2e_qwen3_moe_ep2_rollout.yaml")
    done = _run_demo(path, "--weight-sync-inflight-policy", policy)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = [line for line in done.stdout.splitlines() if "rollout started on version" in line]
    assert len(reports) == 4 and all(line.endswith("(ok)") for line in reports), reports
    if policy == "abort":
        assert all("weight_versions [(1, 0, 5)]" in r or "weight_versions [(2, 0, 5)]" in r for r in reports)
    else:
        assert "kv_versions [(1, 0, 10), (2, 10, 21)]" in reports[0]
