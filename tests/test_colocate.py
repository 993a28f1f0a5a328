"""Colocated launching: one torchrun job holding the trainer's and the engines' ranks (launch/colocate.sh).

The role split is pure (`megatron_sync.drivers.colocate.role_of`: ranks numbered within each role, host by host,
each role with its own rendezvous port). Then the real thing: one torchrun job of 2 processes on this host,
a trainer rank running the custom loop with the memory handoff (`--handoff`) and an inference rank serving
the reference engine, syncing over `transport: ipc`: every step the engine frees its weights for training
and takes them back for the sync, the trainer syncs its initial weights and then one version per step, the
engine ends on the last one, and no shared-memory segment is left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from megatron_sync.drivers.colocate import colocated, role_of, split_arguments
from megatron_sync.transports.ipc.segments import leftover_segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(rank: int, local: int, world: int, per_host: int) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_host),
            "MASTER_PORT": "29500"}


@pytest.mark.parametrize("rank,expected", [
    (0, ("trainer", 0, 4, 0, 29501)), (1, ("trainer", 1, 4, 1, 29501)), (2, ("inference", 0, 4, 0, 29502)),
    (3, ("inference", 1, 4, 1, 29502)), (4, ("trainer", 2, 4, 0, 29501)), (7, ("inference", 3, 4, 1, 29502)),
])
def test_two_hosts_of_two_trainer_and_two_inference_ranks_number_each_role_host_by_host(rank, expected):
    role = role_of(_env(rank, rank % 4, 8, 4), trainer_ranks=2)
    assert (role.name, role.rank, role.world_size, role.local_rank, role.master_port) == expected
    assert role.environment()["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    # both roles know they share the host's devices (transport auto considers ipc), a plain job does not
    assert colocated(role.environment()) and not colocated(_env(rank, rank % 4, 8, 4))


def test_a_host_without_inference_ranks_and_missing_serve_arguments_are_refused():
    with pytest.raises(ValueError, match="must leave each host at least one inference rank"):
        role_of(_env(0, 0, 2, 2), trainer_ranks=2)
    with pytest.raises(ValueError, match="no --serve"):
        split_arguments(["--config", "train.yaml"])
    assert split_arguments(["--steps", "2", "--serve", "--engine", "reference"]) == (["--steps", "2"],
                                                                                   ["--engine", "reference"])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_one_torchrun_job_trains_and_serves_taking_turns_over_ipc(tmp_path):
    from tests.support.dist import free_port
    from tests.test_launch import _model_dir

    model_dir = _model_dir(tmp_path / "model", "qwen3")
    run_id = f"colocate-{os.urandom(4).hex()}"
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"weight_sync": {
        "family": "qwen3", "hf_config_path": os.path.join(model_dir, "config.json"), "dtype": "float32",
        "master_port": free_port(), "num_inference_ranks": 1, "engine_tp_size": 1, "timeout_s": 60,
        "bucket_size_mb": 0.5, "transport": "ipc", "metrics_path": str(tmp_path / "metrics.jsonl"),
        "run_id": run_id,  # the session's id: its segments are told from other tests' running meanwhile
    }}))
    env = {**os.environ, "PYTHON": sys.executable, "NTRAIN": "1", "NSERVE": "1", "MASTER_PORT": str(free_port()),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "launch/colocate.sh", "--module", "examples.custom_loop", "--", "--config", str(config),
         "--steps", "2", "--handoff", "--serve", "--engine", "reference", "--model-dir", model_dir,
         "--config", str(config)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "[custom loop] step 2: loss" in out and "synced version 3" in out, out[-3000:]
    assert "[inference rank 0] stopped on version 3" in out, out[-3000:]
    handoffs = [line for line in out.splitlines() if line.startswith("[custom loop] handoff:")]
    assert len(handoffs) == 2 and all("engine-handoff 1 release" in h and "engine-handoff 1 restore" in h
                                      and "trainer-handoff 0 release" in h for h in handoffs), handoffs
    assert "trainer-handoff 0 restore" in handoffs[1]  # the grads it gave up for the first sync came back
    assert leftover_segments(run_id) == [] and f"session {run_id}" in out  # the segments were the session's
