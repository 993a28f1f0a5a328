"""Tier 3 (independent check): Hugging Face transformers, loaded with the streamed weights, computes Megatron's logits.

For every family, in gloo worker processes: build the tiny Megatron model,
load seeded reference weights, run Megatron's own forward on fixed tokens,
stream the weights through the library's gather + convert path
(``MegatronWeightStream``, float32 target so that no rounding is added), then
on the stage source save them as a safetensors checkpoint and load it with
``AutoModelForCausalLM.from_pretrained`` (see ``tests.support.hf_check``
for why the checkpoint path). Nothing of the library is on the HF side: a wrong
name, a wrong QKV / gate-up split, a shard gathered in the wrong order, a
dropped router bias or an untrimmed vocabulary either fails to load or moves
the logits.

Tolerance: both sides compute the same float32 function of the same float32
weights, but with different kernels and reduction orders (Megatron's baddbmm
attention with its own softmax vs. transformers' attention kernel; fused vs. split QKV and
gate/up GEMMs; Megatron's MoE permute/unpermute vs. transformers' expert loop;
with TP/EP, partial sums all-reduced over ranks). Each regrouping moves a
float32 result by a few ulps. Observed max |HF - Megatron| over logits of
magnitude up to ~4: 2.4e-6 to 3.9e-6 single-rank, up to 4.4e-6 with TP=2
(deepseek_v3) or EP=2. ATOL = 5e-5 leaves a >10x margin; the negative controls
(single-rank run) show that the smallest realistic mistakes (gate/up swapped,
two experts swapped, DeepSeek-V3's routing bias dropped) move logits by 2-4,
five orders of magnitude more. MoE routing is a discrete top-k of router
scores; a ~1e-6 change could flip a near-tie, which would show up as a large
diff. None occurs for these seeds and tokens.

gpt-oss and Qwen3-Next run megatron-core's own attention sinks, sliding windows
(16 tokens span several of gpt-oss's 4-token windows), clamped SwiGLU experts with
biases, GatedDeltaNet (chunked gated delta rule in float32 on both sides), gated
attention and gated shared expert (see tests/support/cpu_hybrid.py); observed
2.2e-6 to 2.8e-6 (gpt-oss) and 6.8e-6, 1.3e-5 at TP=2 (Qwen3-Next). Their controls: sinks dropped, gate/up
not interleaved, in_proj not regrouped by key head, gate heads not interleaved
with the query heads, the gated norm without its +1 (each moves logits by 4-7).
gpt-oss's expert biases need expert TP 1 (megatron-core 0.16.1), hence tp2-etp1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import KIMI_K2, ModelSpec

pytestmark = pytest.mark.multiproc

ATOL = 5e-5
SEED = 3
CASES = {
    "llama": ModelSpec(family="llama"),
    "qwen2": ModelSpec(family="qwen2"),
    "qwen3": ModelSpec(family="qwen3"),
    "qwen3_tied": ModelSpec(family="qwen3", tie_word_embeddings=True),
    "qwen3_moe": ModelSpec(family="qwen3_moe"),
    "deepseek_v3": ModelSpec(family="deepseek_v3"),
    "gpt_oss": ModelSpec(family="gpt_oss", num_experts=4, rms_norm_eps=1e-5),
    "qwen3_next": ModelSpec(family="qwen3_next", num_experts=4),
    # GLM-4.5: q/k/v biases, QK norm, RoPE on half of each head, sigmoid router with correction bias
    "glm4_moe": ModelSpec(family="glm4_moe", partial_rotary_factor=0.5),
    # Kimi-K2's shape: 32 experts (8 per token), one dense layer, MLA, routed_scaling_factor 2.827
    "kimi_k2": ModelSpec(**KIMI_K2),
}
MOE_CASES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "glm4_moe", "kimi_k2")
EXPERT_BIAS_CASES = ("gpt_oss",)  # expert biases: megatron-core 0.16.1 wants expert TP 1


def _tokens(spec: ModelSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, spec.vocab_size, (2, 16), generator=gen)


@dataclasses.dataclass
class CaseResult:
    megatron: torch.Tensor
    hf: torch.Tensor
    problems: list[str]
    model_class: str
    controls: dict[str, float]  # negative control name -> max |logits - correct HF logits|


def _negative_controls(tensors: dict, spec: ModelSpec, tokens, reference: torch.Tensor) -> dict[str, float]:
    """Return how far plausible conversion mistakes move the HF logits (must be >> ATOL)."""
    from tests.support.hf_check import hf_logits_from_checkpoint
    from tests.support.models import hf_config

    variants = {}
    mlp = "model.layers.0.mlp."
    if f"{mlp}gate_proj.weight" in tensors:  # the gated-MLP order mistake
        variants["gate/up swapped"] = {**tensors, f"{mlp}gate_proj.weight": tensors[f"{mlp}up_proj.weight"],
                                       f"{mlp}up_proj.weight": tensors[f"{mlp}gate_proj.weight"]}
    if spec.is_moe:  # an expert-index mistake (EP offset)
        experts = f"model.layers.{spec.moe_layers[0]}.mlp.experts."
        down = experts + ("{}.down_proj" if f"{experts}0.down_proj" in tensors else "{}.down_proj.weight")
        variants["two experts swapped"] = {**tensors, down.format(0): tensors[down.format(1)],
                                           down.format(1): tensors[down.format(0)]}
    if spec.traits.router_bias:  # the bias only changes which experts are chosen
        variants["routing bias dropped"] = {
            n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in tensors.items()
        }
    variants.update(_FAMILY_CONTROLS.get(spec.family, lambda tensors, spec: {})(tensors, spec))
    config = hf_config(spec)
    return {
        what: (hf_logits_from_checkpoint(t.items(), config, tokens).logits - reference).abs().max().item()
        for what, t in variants.items()
    }


def _gpt_oss_controls(tensors: dict, spec: ModelSpec) -> dict[str, dict]:
    from megatron_sync.convert.layout import deinterleave_gate_up

    gate_up = {f"model.layers.0.mlp.experts.{e}.gate_up_proj" for e in range(spec.num_experts)}
    return {
        "sinks dropped": {n: torch.zeros_like(t) if n.endswith("sinks") else t for n, t in tensors.items()},
        "gate/up not interleaved": {n: deinterleave_gate_up(t.t()).t() if n in gate_up else t
                                    for n, t in tensors.items()},
    }


def _qwen3_next_controls(tensors: dict, spec: ModelSpec) -> dict[str, dict]:
    from megatron_sync.convert.layout import merge_gated_qkv, merge_gdn_in_proj
    from tests.support.models import hf_config

    cfg = hf_config(spec)
    a, g = "model.layers.1.self_attn.", "model.layers.0.linear_attn."
    qkvz, ba = tensors[g + "in_proj_qkvz.weight"], tensors[g + "in_proj_ba.weight"]
    in_proj = merge_gdn_in_proj(qkvz, ba, num_key_heads=cfg.linear_num_key_heads,
                                num_value_heads=cfg.linear_num_value_heads, key_head_dim=cfg.linear_key_head_dim,
                                value_head_dim=cfg.linear_value_head_dim)
    q_proj = tensors[a + "q_proj.weight"]
    qkv = merge_gated_qkv(q_proj, tensors[a + "k_proj.weight"], tensors[a + "v_proj.weight"],
                          num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                          head_dim=cfg.head_dim)
    return {
        "in_proj not grouped by key head": {**tensors, g + "in_proj_qkvz.weight": in_proj[:qkvz.shape[0]],
                                            g + "in_proj_ba.weight": in_proj[qkvz.shape[0]:]},
        "gate heads not interleaved": {**tensors, a + "q_proj.weight": qkv[:q_proj.shape[0]]},
        "gated norm without +1": {**tensors, g + "norm.weight": tensors[g + "norm.weight"] - 1},
    }


# Mistakes in the layout steps a family adds: control name -> the tensors that mistake would have sent.
_FAMILY_CONTROLS = {"gpt_oss": _gpt_oss_controls, "qwen3_next": _qwen3_next_controls}


def _run_case(spec: ModelSpec, controls: bool):
    from tests.support.hf_check import stream_and_check

    tokens = _tokens(spec)
    case = stream_and_check(spec, SEED, tokens)
    if case is None:
        return None
    report = case.report
    return CaseResult(
        megatron=case.megatron, hf=report.logits, problems=report.problems, model_class=report.model_class,
        controls=_negative_controls(case.tensors, spec, tokens, report.logits) if controls else {},
    )


def _worker(rank, world_size, layout_kw, cases, controls):
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    return {name: _run_case(CASES[name], controls) for name in cases}


LAYOUTS = [
    pytest.param(1, {}, tuple(CASES), True, id="single-rank"),
    pytest.param(2, dict(tp=2), tuple(c for c in CASES if c not in EXPERT_BIAS_CASES), False,
                 id="tp2"),  # MoE: ETP=TP=2
    pytest.param(2, dict(tp=2, etp=1), EXPERT_BIAS_CASES, False, id="tp2-etp1"),
    pytest.param(2, dict(ep=2), MOE_CASES, False, id="ep2"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,layout_kw,cases,controls", LAYOUTS)
def test_hf_logits_equal_megatron_logits(world_size, layout_kw, cases, controls):
    per_rank = run_distributed(_worker, world_size, layout_kw, cases, controls, timeout=200)
    results, others = per_rank[0], per_rank[1:]
    assert all(r is None for other in others for r in other.values()), "PP=1: only rank 0 is the source"
    failures = []
    for name in cases:
        r = results[name]
        if r.problems:
            failures.append(f"{name}: from_pretrained ({r.model_class}) did not load cleanly: {r.problems}")
            continue
        assert r.hf.shape == r.megatron.shape == (2, 16, CASES[name].vocab_size), name
        diff = (r.hf - r.megatron).abs().max().item()
        print(f"{name}: max |HF - Megatron| = {diff:.3g}; controls {r.controls}")  # shown with -s
        if not diff <= ATOL:
            failures.append(f"{name}: max |HF - Megatron| logits = {diff:.3g} > {ATOL} ({r.model_class})")
        for what, moved in r.controls.items():
            if not moved > 100 * ATOL:
                failures.append(f"{name}: negative control '{what}' moved logits only {moved:.3g}")
    assert not failures, "\n".join(failures)
