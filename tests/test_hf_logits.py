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
    # GLM-4.5: q/k/v biases, QK norm, RoPE on half of each head, sigmoid router with correction bias
    "glm4_moe": ModelSpec(family="glm4_moe", partial_rotary_factor=0.5),
    # Kimi-K2's shape: 32 experts (8 per token), one dense layer, MLA, routed_scaling_factor 2.827
    "kimi_k2": ModelSpec(**KIMI_K2),
}
MOE_CASES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "kimi_k2")


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
        down = f"model.layers.{spec.moe_layers[0]}.mlp.experts.{{}}.down_proj.weight"
        variants["two experts swapped"] = {**tensors, down.format(0): tensors[down.format(1)],
                                           down.format(1): tensors[down.format(0)]}
    if spec.traits.router_bias:  # the bias only changes which experts are chosen
        variants["routing bias dropped"] = {
            n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in tensors.items()
        }
    config = hf_config(spec)
    return {
        what: (hf_logits_from_checkpoint(t.items(), config, tokens).logits - reference).abs().max().item()
        for what, t in variants.items()
    }


def _run_case(spec: ModelSpec, controls: bool):
    from converters import get_converter
    from megatron_sync.parallel import ParallelLayout
    from megatron_sync.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.hf_check import hf_logits_from_checkpoint

    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=SEED), spec)
    tokens = _tokens(spec)
    megatron = models.megatron_logits(chunks, tokens)
    config = models.hf_config(spec)
    stream = MegatronWeightStream(
        chunks, ParallelLayout.from_megatron(), get_converter(spec.family, config, dtype=torch.float32)
    )
    tensors = {name: tensor.clone() for name, tensor in stream}  # collective: every rank iterates
    if not stream.is_source:
        assert not tensors, "a non-source rank received tensors"
        return None
    report = hf_logits_from_checkpoint(tensors.items(), config, tokens)
    return CaseResult(
        megatron=megatron, hf=report.logits, problems=report.problems, model_class=report.model_class,
        controls=_negative_controls(tensors, spec, tokens, report.logits) if controls else {},
    )


def _worker(rank, world_size, layout_kw, cases, controls):
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    return {name: _run_case(CASES[name], controls) for name in cases}


LAYOUTS = [
    pytest.param(1, {}, tuple(CASES), True, id="single-rank"),
    pytest.param(2, dict(tp=2), tuple(CASES), False, id="tp2"),  # MoE: ETP=TP=2
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
