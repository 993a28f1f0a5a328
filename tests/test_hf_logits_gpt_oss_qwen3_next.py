"""Tier 3 (independent check) for gpt-oss and Qwen3-Next: transformers, loaded with the streamed weights,
computes Megatron's logits.

As tests/test_hf_logits.py: a tiny Megatron model of each family built on CPU (megatron-core's own
attention sinks, sliding windows, clamped SwiGLU experts with biases; its own GatedDeltaNet, gated
attention and gated shared expert, see tests/support/cpu_hybrid.py), seeded reference weights,
Megatron's forward on fixed tokens; the weights streamed through the library's gather + convert
(float32 target), saved as a safetensors checkpoint and loaded by `from_pretrained` (gpt-oss's
per-expert tensors stacked over experts, as its checkpoint stores them). 16 tokens span several
of gpt-oss's 4-token windows.

Tolerance as in test_hf_logits.py (5e-5 on float32 logits of magnitude ~4); the gated delta rule
runs chunked in float32 on both sides with different summation orders. The negative controls
(single rank) show that each layout step this family adds moves the logits by orders of magnitude
more: sinks dropped, gate/up not interleaved, Qwen3-Next's in_proj not regrouped by key head, its
gate heads not interleaved with the query heads, its gated norm without the +1.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import ModelSpec

pytestmark = pytest.mark.multiproc

ATOL = 5e-5
SEED = 3
CASES = {
    "gpt_oss": ModelSpec(family="gpt_oss", num_experts=4, rms_norm_eps=1e-5),
    "qwen3_next": ModelSpec(family="qwen3_next", num_experts=4),
}


def _tokens(spec: ModelSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, spec.vocab_size, (2, 16), generator=gen)


def _swap(tensors: dict, name: str, change) -> dict:
    return {**tensors, name: change(tensors[name])}


def _controls(tensors: dict, spec: ModelSpec) -> dict[str, dict]:
    """Plausible layout mistakes, each as the tensors it would have sent."""
    from converters.layout import deinterleave_gate_up, merge_gated_qkv, merge_gdn_in_proj
    from tests.support.models import hf_config

    cfg = hf_config(spec)
    if spec.family == "gpt_oss":
        x = "model.layers.0.mlp.experts.{}.gate_up_proj"
        return {
            "sinks dropped": {n: torch.zeros_like(t) if n.endswith("sinks") else t for n, t in tensors.items()},
            "gate/up not interleaved": {
                n: deinterleave_gate_up(t.t()).t() if n in {x.format(e) for e in range(spec.num_experts)} else t
                for n, t in tensors.items()},
        }
    a, g = "model.layers.1.self_attn.", "model.layers.0.linear_attn."
    heads = dict(num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                 head_dim=cfg.head_dim)
    gdn = dict(num_key_heads=cfg.linear_num_key_heads, num_value_heads=cfg.linear_num_value_heads,
               key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim)
    megatron_in_proj = merge_gdn_in_proj(tensors[g + "in_proj_qkvz.weight"], tensors[g + "in_proj_ba.weight"], **gdn)
    qkvz_rows = tensors[g + "in_proj_qkvz.weight"].shape[0]
    megatron_qkv = merge_gated_qkv(*(tensors[a + f"{p}_proj.weight"] for p in "qkv"), **heads)
    return {
        "in_proj not grouped by key head": {**tensors, g + "in_proj_qkvz.weight": megatron_in_proj[:qkvz_rows],
                                            g + "in_proj_ba.weight": megatron_in_proj[qkvz_rows:]},
        "gate heads not interleaved": _swap(tensors, a + "q_proj.weight",
                                            lambda t: megatron_qkv[:t.shape[0]]),
        "gated norm without +1": _swap(tensors, g + "norm.weight", lambda t: t - 1),
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
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(),
                                  get_converter(spec.family, config, dtype=torch.float32))
    tensors = {name: tensor.clone() for name, tensor in stream}  # collective: every rank iterates
    if not stream.is_source:
        assert not tensors, "a non-source rank received tensors"
        return None
    report = hf_logits_from_checkpoint(tensors.items(), config, tokens)
    moved = {}
    if controls:
        for what, variant in _controls(tensors, spec).items():
            logits = hf_logits_from_checkpoint(variant.items(), config, tokens).logits
            moved[what] = (logits - report.logits).abs().max().item()
    return dict(megatron=megatron, hf=report.logits, problems=report.problems, model_class=report.model_class,
                controls=moved)


def _worker(rank, world_size, layout_kw, cases, controls):
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    return {name: _run_case(CASES[name], controls) for name in cases}


LAYOUTS = [
    pytest.param(1, {}, tuple(CASES), True, id="single-rank"),
    pytest.param(2, dict(tp=2, etp=1), tuple(CASES), False, id="tp2"),  # gpt-oss: expert biases need ETP=1
    pytest.param(2, dict(ep=2), tuple(CASES), False, id="ep2"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,layout_kw,cases,controls", LAYOUTS)
def test_hf_logits_equal_megatron_logits(world_size, layout_kw, cases, controls):
    per_rank = run_distributed(_worker, world_size, layout_kw, cases, controls, timeout=250)
    results, others = per_rank[0], per_rank[1:]
    assert all(r is None for other in others for r in other.values()), "PP=1: only rank 0 is the source"
    failures = []
    for name in cases:
        r = results[name]
        if r["problems"]:
            failures.append(f"{name}: from_pretrained ({r['model_class']}) did not load cleanly: {r['problems']}")
            continue
        assert r["hf"].shape == r["megatron"].shape == (2, 16, CASES[name].vocab_size), name
        diff = (r["hf"] - r["megatron"]).abs().max().item()
        print(f"{name}: max |HF - Megatron| = {diff:.3g}; controls {r['controls']}")  # shown with -s
        if not diff <= ATOL:
            failures.append(f"{name}: max |HF - Megatron| logits = {diff:.3g} > {ATOL} ({r['model_class']})")
        for what, moved in r["controls"].items():
            if not moved > 100 * ATOL:
                failures.append(f"{name}: negative control '{what}' moved logits only {moved:.3g}")
    assert not failures, "\n".join(failures)
