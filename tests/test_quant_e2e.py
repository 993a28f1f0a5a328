"""End to end: quantized syncs from Megatron trainer layouts into a reference engine with its own TP=2.

- DeepSeek-V3, FP8 blocks of [16, 32] (small enough for the tiny model's TP=2 shards, non-square on
  purpose; `kv_a_proj_with_mqa` has 40 rows: a partial last block): trainer at TP=2 for the dense
  parts and EP=2 for the experts (ETP=1), one version (Megatron refuses to train MoE at TP>1
  without sequence parallelism, which needs Transformer Engine).
- Qwen3-MoE, INT4 routed experts (compressed-tensors pack-quantized, group 32): trainer at EP=2, two
  versions an optimizer step apart (so a trained version goes through quantization and the
  engine's snapshot in the wire format).

Both run the real drivers (`tests/support/jobs.py::run_pair`): the trainer's HF config carries the
`quantization_config`, so its converter quantizes the gathered full tensors in the convert stage and
the engine expects, slices and dequantizes the quantized names. Per version:

1. Every tensor the trainer sent equals, bit for bit, the engine library's quantization (vLLM's
   DeepGEMM block cast, compressed-tensors' compressor) of the trainer's unquantized conversion (the
   same gather recorded without quantization; at version 1 it is also checked equal to the
   single-rank conversion of the seeded weights).
2. Every shard an engine rank holds equals the engine's slicing of that reference output, and for each
   quantized weight also the library's own quantization of the rank's float slice (block-local scales:
   a block never straddles the shard edge), computed here without the engine.
3. Each quantized weight dequantizes within its format's elementwise error bound.
4. Logits. The tolerance follows from the triangle inequality
       |engine - trainer| <= |engine - HF(deq)| + |HF(deq) - HF(float)| + |HF(float) - trainer|
   where HF(w) is transformers' forward (`from_pretrained`) on weights w, deq the sent tensors
   dequantized, float the unquantized conversion. The outer terms are float32 reduction-order noise
   and are asserted < LOGITS_ATOL (1e-4, as in the unquantized end-to-end tests; observed ~5e-6);
   the middle term is the quantization's own effect on this model, measured here (max |diff| about
   1.0 for FP8 and 1.2-1.4 for INT4, on logits of max |logit| 3.5: tiny random models with top-k
   routing, where a perturbed hidden state can change an expert choice). So the engine must match
   the dequantized model to 1e-4 (the tight check) and the trainer to measured + 2e-4. That the
   effect is large also shows the engine really computes with the dequantized weights (float weights
   would miss HF(deq) by the effect itself). Negative control: the same engine loaded with the
   scales of one projection in every layer cut for the other TP rank (the block rows swapped)
   misses HF(deq) by far more than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.convert import Shard, get_converter
from tests.support import models
from tests.support.fakes import shard_of
from tests.support.quant_refs import (
    FP8_BLOCK, INT4_EXPERTS, TINY_QUANTIZED_SPECS, assert_bits_equal, reference_checkpoint, reference_quantize,
    within_format_bound,
)

LOGITS_ATOL = 1e-4  # float32, different kernels and reduction order
TP = 2


def weight_slice(converter, weight: str, x: torch.Tensor, rank: int) -> torch.Tensor:
    """A TP rank's part of a float weight, written out from the roles (COLUMN rows, ROW cols; the
    families quantized here have no KV_HEADS weights under these configs)."""
    role = converter.shard_role(weight)
    if role in (Shard.REPLICATED, Shard.VOCAB):  # the reference engine keeps vocabulary tensors whole
        return x
    assert role in (Shard.COLUMN, Shard.ROW), (weight, role)
    dim = 0 if role is Shard.COLUMN else 1
    step = x.shape[dim] // TP
    return x.narrow(dim, rank * step, step).contiguous()


def dequantized(converter, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights the sent checkpoint stands for (HF names, not quantized)."""
    return {w: converter.quant.dequantize(w, sent, torch.float32)
            for w in converter.expected_hf_tensors(quantized=False)}


def check_quantized_sync(case: dict, trainer: list, engines: list) -> None:
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.hf_check import hf_logits_from_checkpoint
    from tests.support.jobs import EVAL_TOKENS, case_hf_config

    spec = models.ModelSpec(**case["spec"])
    config, plain_config = case_hf_config(case), models.hf_config(spec)
    converter = get_converter(spec.family, config, dtype=torch.float32)
    slicers = [ReferenceEngine(config, tp_rank=r, tp_size=TP) for r in range(TP)]
    lead = trainer[0]
    assert len(lead["sent"]) == case["versions"] and [h["version"] for h in engines[0]["held"]] == [
        v + 1 for v in range(case["versions"])]
    single_rank = get_converter(spec.family, plain_config, dtype=torch.float32)
    first = {n: t for m, x in models.reference_weights(spec, seed=3).items() for n, t in single_rank.convert(m, x)}
    assert first.keys() == lead["unquantized"][0].keys()
    for name, t in first.items():
        assert_bits_equal(lead["unquantized"][0][name], t, f"gathered {name}")
    for version, (sent, hf) in enumerate(zip(lead["sent"], lead["unquantized"])):
        reference = reference_checkpoint(converter, hf)
        assert sent.keys() == reference.keys() == converter.expected_hf_tensors().keys()
        for name, t in reference.items():
            assert_bits_equal(sent[name], t, f"v{version + 1} sent {name}")
        for weight, scheme in converter.quant.schemes.items():
            assert within_format_bound(weight, hf[weight], sent, scheme), weight
        for rank, (engine, slicer) in enumerate(zip(engines, slicers)):
            shards = engine["held"][version]["shards"]
            assert shards.keys() == reference.keys()
            for name, t in reference.items():
                assert_bits_equal(shards[name], shard_of(slicer, name, t).contiguous(), f"v{version + 1} r{rank} {name}")
            for weight, scheme in converter.quant.schemes.items():
                own = reference_quantize(weight, weight_slice(converter, weight, hf[weight], rank), scheme)
                for name, t in own.items():
                    if name.endswith(".weight_shape"):  # held whole, as vLLM loads it: the whole weight's shape
                        t = torch.tensor(list(hf[weight].shape), dtype=torch.int64)
                    assert_bits_equal(shards[name], t, f"v{version + 1} r{rank} {name} from the rank's slice")
        hf_float = hf_logits_from_checkpoint(hf.items(), plain_config, EVAL_TOKENS)
        hf_deq = hf_logits_from_checkpoint(dequantized(converter, sent).items(), plain_config, EVAL_TOKENS)
        assert not hf_float.problems and not hf_deq.problems
        trainer_logits = lead["logits"][version]
        effect = (hf_deq.logits - hf_float.logits).abs().max().item()
        assert (hf_float.logits - trainer_logits).abs().max().item() < LOGITS_ATOL
        assert effect > 100 * LOGITS_ATOL, effect  # quantization visibly matters on this model
        for rank, engine in enumerate(engines):
            logits = engine["held"][version]["logits"]
            to_deq, to_trainer = ((logits - ref).abs().max().item() for ref in (hf_deq.logits, trainer_logits))
            print(f"[{spec.family} v{version + 1} engine rank {rank}] max |logits diff|: vs HF(dequantized) "
                  f"{to_deq:.2e}, vs trainer {to_trainer:.3f} (tolerance {effect + 2 * LOGITS_ATOL:.3f} = measured "
                  f"quantization effect + 2e-4; max |logit| {trainer_logits.abs().max().item():.2f})")
            assert to_deq < LOGITS_ATOL, version
            assert to_trainer <= effect + 2 * LOGITS_ATOL, version
    negative_control(config, lead["sent"][-1], hf_deq.logits, EVAL_TOKENS)  # the last version's


def negative_control(config, sent: dict[str, torch.Tensor], hf_deq_logits: torch.Tensor, tokens) -> None:
    """The scales of every quantized o_proj and down_proj cut for the other TP rank (their column blocks
    or groups swapped): a block straddling the shard boundary the wrong way moves the logits far beyond
    LOGITS_ATOL."""
    from megatron_sync.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(config, tp_rank=0, tp_size=1)
    engine.load_shards(sent, 1)
    assert (engine.logits(tokens) - hf_deq_logits).abs().max().item() < LOGITS_ATOL
    quant = engine.converter.quant
    wrong = dict(sent)
    swapped = 0
    for weight, scheme in quant.schemes.items():
        if weight.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            scale = next(n for n in scheme.output_names(weight) if n.endswith("weight_scale_inv")
                         or n.endswith("weight_scale"))
            wrong[scale] = sent[scale].roll(sent[scale].shape[1] // TP, dims=1)  # ROW: the other rank's columns
            swapped += 1
    assert swapped
    engine.load_shards(wrong, 2)
    moved = (engine.logits(tokens) - hf_deq_logits).abs().max().item()
    print(f"negative control: scales of {swapped} weights cut for the other rank move the logits by {moved:.3f}")
    assert moved > 1000 * LOGITS_ATOL


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_deepseek_v3_fp8_block_from_tp2_ep2_into_engine_tp2():
    from tests.support.jobs import run_pair

    case = {"spec": TINY_QUANTIZED_SPECS["deepseek_v3"], "layout": {"tp": 2, "ep": 2, "etp": 1}, "versions": 1,
            "quantization_config": FP8_BLOCK, "record_unquantized": True}
    trainer, engines = run_pair(case, timeout=500)
    check_quantized_sync(case, trainer, engines)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_qwen3_moe_int4_experts_from_ep2_into_engine_tp2_across_a_training_step():
    from tests.support.jobs import run_pair

    case = {"spec": TINY_QUANTIZED_SPECS["qwen3_moe"], "layout": {"ep": 2}, "versions": 2,
            "quantization_config": INT4_EXPERTS, "record_unquantized": True}
    trainer, engines = run_pair(case, timeout=500)
    sent = trainer[0]["sent"]
    assert any(not torch.equal(sent[0][n], sent[1][n]) for n in sent[0] if n.endswith("weight_packed"))
    check_quantized_sync(case, trainer, engines)
