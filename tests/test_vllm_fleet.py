"""A vLLM server in a fleet beside a reference engine: killed between syncs, restarted, driven back in.

The trainer (one Megatron rank) drives the vLLM server (engine 0, `weight_sync.engines`) and a reference
engine joins as engine 1 on its own. Version 1 reaches both; the server is then killed and version 2 reaches
the reference engine alone while training goes on; the server is restarted on its port and, at the next
sync boundary, the trainer asks it to join again: it is admitted as engine 0's next generation and serves
version 3, its greedy tokens transformers' on exactly the tensors the trainer sent.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support.dist import free_port, run_ranks
from tests.support.fleet_jobs import reference_fleet_engine
from tests.support.real_engines import (
    QWEN3, TrainerProcess, VLLMServer, engine_problems, serving, tiny_hf_config, weight_version,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]


def _by_engine(rows: list[dict]) -> dict[int, str]:
    return {r["engine"]: r["outcome"] for r in rows if "outcome" in r}


def test_a_vllm_server_killed_between_syncs_is_driven_back_into_the_fleet(tmp_path):
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    with serving(str(tmp_path), QWEN3, env=env) as (server, _), TrainerProcess(QWEN3) as trainer, \
            ThreadPoolExecutor(max_workers=1) as pool:
        settings = {"family": "qwen3", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": 1,
                    "engine_tp_size": 1, "bucket_size_mb": 0.05, "timeout_s": 60, "fleet": True,
                    "engines": [f"vllm={server.url}"]}
        reference = pool.submit(run_ranks, reference_fleet_engine, 1, settings, QWEN3, 1, timeout=600)
        trainer.connect(**settings)  # the server's worker joins as engine 0
        trainer.call("await_engines", {1: 0})
        sent = {}

        trainer.load(1)
        first = trainer.call("sync_rows")
        sent[1] = trainer.sent()
        assert _by_engine(first["fleet"]) == {0: "committed", 1: "committed"}, first
        assert engine_problems(server.url, QWEN3, sent[1], PROMPTS) == []
        assert weight_version(server.url) == "1"

        server.stop()  # killed between syncs; training and syncing go on with the reference engine
        trainer.load(2)
        second = trainer.call("sync_rows")
        sent[2] = trainer.sent()
        assert _by_engine(second["fleet"]) == {0: "failed", 1: "committed"} or \
            _by_engine(second["fleet"]) == {1: "committed"}, second
        assert any(r.get("event") == "left" and r["engine"] == 0 for r in second["fleet"]), second

        restarted = VLLMServer(os.path.join(str(tmp_path), "model"), log_path=os.path.join(str(tmp_path), "server.log"),
                               env=env, port=server.port)
        try:
            restarted.wait_ready()
            trainer.load(3)
            third = trainer.call("sync_rows")  # the boundary drives the restarted server back in
            sent[3] = trainer.sent()
            assert _by_engine(third["fleet"]) == {0: "committed", 1: "committed"}, third
            rejoined = [r for r in third["fleet"] if r.get("event") == "rejoined"]
            assert [(r["engine"], r["generation"]) for r in rejoined] == [(0, 1)], third
            assert engine_problems(restarted.url, QWEN3, sent[3], PROMPTS) == []
            assert weight_version(restarted.url) == "3"
            trainer.disconnect()
        finally:
            restarted.stop()
        (status, out), = reference.result().values()

    assert status == "ok", out
    from megatron_sync.engines.reference.engine import ReferenceEngine
    slicer = ReferenceEngine(tiny_hf_config(QWEN3), tp_rank=0, tp_size=1)
    assert [h["version"] for h in out["held"]] == [1, 2, 3]
    for held in out["held"]:
        for name, shard in held["shards"].items():
            assert torch.equal(shard, slicer.rank_layout().by_name[name][0].source.of(sent[held["version"]][name]))
