"""Quantization inside the sync: the converter's quantized checkpoint and the reference engine's use of it.

No processes: the single-rank conversion of a tiny model's weights through a
converter whose HF config carries a `quantization_config`, compared bit for bit
with the libraries engines ship (`tests/support/quant_refs.py`: vLLM's DeepGEMM
block cast and QuantFP8, compressed-tensors' compressor); the metadata,
completeness check and keep-together groups that speak the quantized names;
and the reference engine, which cuts a weight's scales with the weight, loads
the quantized shards by dequantizing them, snapshots them in the wire format,
and computes the logits transformers computes from independently dequantized
weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.convert import MissingTensorError, Shard, UnexpectedTensorError, get_converter, keep_together_of
from megatron_sync.convert.errors import ConfigError
from megatron_sync.convert.quant import Fp8Block, Fp8Tensor, Int4Group
from megatron_sync.core.meta import TensorMeta
from tests.support import models
from tests.support.fakes import shard_of
from tests.support.quant_refs import (
    FP8_BLOCK, FP8_TENSOR, INT4_EXPERTS, TINY_QUANTIZED_SPECS, assert_bits_equal, ct_decompress, reference_checkpoint,
    reference_quantize,
)

CASES = [("deepseek_v3", FP8_BLOCK), ("qwen3_moe", FP8_TENSOR), ("qwen3_moe", INT4_EXPERTS),
         ("deepseek_v3", INT4_EXPERTS)]
IDS = ["deepseek_v3-fp8_block", "qwen3_moe-fp8_tensor", "qwen3_moe-int4", "deepseek_v3-int4"]


def tiny(family: str, quantization_config: dict | None, **spec):
    """Return (ModelSpec, HF config with `quantization_config`) of the tiny model of `family`."""
    spec = models.ModelSpec(**{**TINY_QUANTIZED_SPECS[family], **spec})
    config = models.hf_config(spec)
    if quantization_config is not None:
        config.quantization_config = quantization_config
    return spec, config


def unquantized_hf(family: str, spec, seed: int = 3) -> dict[str, torch.Tensor]:
    """The single-rank HF conversion of the tiny model's weights, float32, not quantized."""
    converter = get_converter(family, models.hf_config(spec), dtype=torch.float32)
    return {n: t for m, x in models.reference_weights(spec, seed=seed).items() for n, t in converter.convert(m, x)}


def independent_dequantize(name: str, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
    """Dequantize without megatron_sync.convert.quant: the FP8 formula written out, INT4 through compressed-tensors."""
    prefix = name.removesuffix("weight")
    if isinstance(scheme, Int4Group):
        parts = {k: tensors[prefix + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        return ct_decompress(parts, scheme.group_size).float()
    q = tensors[name].float()
    if isinstance(scheme, Fp8Tensor):
        return q * tensors[prefix + "weight_scale"]
    (bo, bi), s = scheme.block, tensors[prefix + "weight_scale_inv"]
    return q * s.repeat_interleave(bo, 0)[: q.shape[0]].repeat_interleave(bi, 1)[:, : q.shape[1]]


# -- the converter ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family,qc", CASES, ids=IDS)
def test_convert_equals_the_engines_library_bit_for_bit(family, qc):
    spec, config = tiny(family, qc)
    converter = get_converter(family, config, dtype=torch.float32)
    plain = get_converter(family, models.hf_config(spec), dtype=torch.float32)
    produced = {}
    for megatron_name, x in models.reference_weights(spec, seed=3).items():
        out = converter.convert(megatron_name, x)
        assert [TensorMeta.of(n, t) for n, t in out] == converter.convert_meta(megatron_name, x.shape, x.dtype)
        want = reference_checkpoint(converter, dict(plain.convert(megatron_name, x)))
        assert sorted(n for n, _ in out) == sorted(want), megatron_name
        for name, t in out:
            assert_bits_equal(t, want[name], name)
        produced.update(out)
    converter.check_complete(list(produced))
    assert {n: (tuple(t.shape), t.dtype) for n, t in produced.items()} == converter.expected_hf_tensors()


@pytest.mark.parametrize("family,qc,selected", [
    ("deepseek_v3", FP8_BLOCK, lambda n: n.endswith(("_proj.weight", "_proj_with_mqa.weight"))),
    ("qwen3_moe", FP8_TENSOR, lambda n: n.endswith("_proj.weight")),
    ("qwen3_moe", INT4_EXPERTS, lambda n: ".mlp.experts." in n),
    ("deepseek_v3", INT4_EXPERTS, lambda n: ".mlp.experts." in n),
], ids=IDS)
def test_selection_follows_the_config_and_the_published_defaults(family, qc, selected):
    converter = get_converter(family, tiny(family, qc)[1], dtype=torch.float32)
    weights = converter.expected_hf_tensors(quantized=False)
    assert set(converter.quant.schemes) == {n for n in weights if selected(n)}
    stays = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
             "model.norm.weight", "model.layers.1.input_layernorm.weight"]
    if family == "deepseek_v3":
        stays.append("model.layers.1.mlp.gate.e_score_correction_bias")
    for name in stays:
        assert converter.expected_hf_tensors()[name] == weights[name], name


def test_missing_or_extra_scale_is_the_same_error_as_a_missing_weight():
    converter = get_converter("deepseek_v3", tiny("deepseek_v3", FP8_BLOCK)[1], dtype=torch.float32)
    names = list(converter.expected_hf_tensors())
    scale = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    with pytest.raises(MissingTensorError, match=scale.replace(".", r"\.")) as missing:
        converter.check_complete(n for n in names if n != scale)
    assert "part of quantized model.layers.2.mlp.experts.3.down_proj.weight" in str(missing.value)
    with pytest.raises(MissingTensorError, match="model.layers.2.mlp.experts.3.down_proj.weight "):
        converter.check_complete(n for n in names if n != "model.layers.2.mlp.experts.3.down_proj.weight")
    extra = "model.layers.1.mlp.gate.weight_scale_inv"
    with pytest.raises(UnexpectedTensorError, match="published quantized checkpoints keep it unquantized"):
        converter.check_complete([*names, extra])
    with pytest.raises(UnexpectedTensorError, match="stored as"):  # a per-tensor scale name for a block weight
        converter.check_complete([*names, "model.layers.0.self_attn.o_proj.weight_scale"])


def test_a_group_that_does_not_divide_a_weight_fails_at_construction_naming_both():
    qc = {**INT4_EXPERTS, "config_groups": {"group_0": {**INT4_EXPERTS["config_groups"]["group_0"], "weights": {
        **INT4_EXPERTS["config_groups"]["group_0"]["weights"], "group_size": 128}}}}
    with pytest.raises(ConfigError, match=r"experts\.0\.gate_proj\.weight.*group_size=128"):
        get_converter("qwen3_moe", tiny("qwen3_moe", qc)[1])


@pytest.mark.parametrize("family,qc", CASES, ids=IDS)
def test_both_sides_keep_every_weight_with_its_scales(family, qc):
    from megatron_sync.plan.buckets import build_plan

    converter = get_converter(family, tiny(family, qc)[1], dtype=torch.float32)
    engine_names = [m.name for m in converter.expected_metas()]
    assert converter.keep_together == keep_together_of(converter.family, engine_names)
    plan = build_plan([converter.expected_metas()], bucket_size_bytes=512, keep_together=converter.keep_together)
    bucket_of = {e.name: b.index for b in plan.buckets for e in b.entries}
    assert len(plan.buckets) > 20
    for weight, scheme in converter.quant.schemes.items():
        assert len({bucket_of[out] for out in scheme.output_names(weight)}) == 1, weight


def test_roles_of_scales_follow_their_weights_and_unquantized_roles_are_unchanged():
    spec, config = tiny("qwen3_moe", INT4_EXPERTS)
    quantized = get_converter("qwen3_moe", config)
    plain = get_converter("qwen3_moe", models.hf_config(spec))
    assert plain.expected_metas() == plain.expected_metas(quantized=False)
    assert plain.keep_together == plain.family.keep_together
    for name in plain.expected_hf_tensors():
        assert quantized.shard_role(name) == plain.shard_role(name), name
    for name in quantized.expected_hf_tensors():
        assert quantized.shard_role(name) == plain.shard_role(quantized.weight_of(name)), name
    assert quantized.shard_role("model.layers.0.mlp.experts.1.down_proj.weight_shape") is Shard.ROW


# -- the reference engine ------------------------------------------------------------------------

def rank_range(role: Shard, shape, rank: int, tp: int, kv_heads: int):
    """(dim, start, stop) of a TP rank's part of a weight, written out from the roles' definitions."""
    if role in (Shard.REPLICATED, Shard.VOCAB):  # the reference engine keeps vocabulary tensors whole
        return None
    if role is Shard.KV_HEADS and kv_heads < tp:
        head, per_head = rank * kv_heads // tp, shape[0] // kv_heads
        return 0, head * per_head, (head + 1) * per_head
    dim = 1 if role is Shard.ROW else 0
    step = shape[dim] // tp
    return dim, rank * step, (rank + 1) * step


@pytest.mark.parametrize("family,qc", CASES[:3], ids=IDS[:3])
def test_engine_shards_are_the_reference_quantization_of_the_weight_shard(family, qc):
    """Every rank's shard of a quantized weight equals the engine library's quantization of that rank's
    slice of the float weight (block-local scales), or for a per-tensor scale the slice of the whole
    weight's quantization; unquantized tensors are the float slices."""
    from megatron_sync.engines.reference.engine import ReferenceEngine

    spec, config = tiny(family, qc)
    hf = unquantized_hf(family, spec)
    for rank in range(2):
        engine = ReferenceEngine(config, tp_rank=rank, tp_size=2)
        full = reference_checkpoint(engine.converter, hf)
        shards = {n: shard_of(engine, n, full[n]) for n in full}
        for weight, x in hf.items():
            scheme = engine.converter.quant.scheme_of(weight)
            cut = rank_range(engine.converter.shard_role(weight), x.shape, rank, 2, config.num_key_value_heads)
            local = x if cut is None else x.narrow(cut[0], cut[1], cut[2] - cut[1]).contiguous()
            if scheme is None:
                want = {weight: local}
            elif isinstance(scheme, Fp8Tensor):
                want = reference_quantize(weight, x, scheme)
                want[weight] = local if cut is None else want[weight].narrow(cut[0], cut[1], cut[2] - cut[1])
            else:
                want = reference_quantize(weight, local, scheme)
                shape = next((n for n in want if n.endswith(".weight_shape")), None)
                if shape is not None:  # INT4's weight_shape is held whole, as vLLM loads it
                    want[shape] = torch.tensor(list(x.shape), dtype=torch.int64)
            for name, t in want.items():
                assert_bits_equal(shards[name].contiguous(), t.contiguous(), f"rank {rank} {name}")
                assert tuple(t.shape) == engine.local_shape(name)


@pytest.mark.parametrize("family,qc", CASES[:3], ids=IDS[:3])
def test_engine_snapshot_is_the_wire_format_and_rolls_back(family, qc):
    from megatron_sync.engines.reference.engine import ReferenceEngine

    spec, config = tiny(family, qc)
    engine = ReferenceEngine(config, tp_rank=1, tp_size=2)
    before = engine.snapshot()
    assert {n: (tuple(t.shape), t.dtype) for n, t in before.items()} == {
        m.name: (engine.local_shape(m.name), m.dtype) for m in engine.expected_tensors()}
    versions = [reference_checkpoint(engine.converter, unquantized_hf(family, spec, seed)) for seed in (3, 4)]
    for version, full in enumerate(versions, start=1):
        engine.load_shards({n: shard_of(engine, n, t).clone() for n, t in full.items()}, version)
    held = engine.snapshot()
    engine.load_shards(before, 0)  # a rollback to the zeros it started from
    assert engine.snapshot().keys() == before.keys()
    for name in before:
        assert_bits_equal(engine.snapshot()[name], before[name], name)
    engine.load_shards(held, 2)
    for name, shard in engine.snapshot().items():
        assert_bits_equal(shard, shard_of(engine, name, versions[1][name]).contiguous(), name)


@pytest.mark.parametrize("family,qc,wrong_scale", [
    ("deepseek_v3", FP8_BLOCK, r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv"),
    ("qwen3_moe", FP8_TENSOR, r"model\.layers\.0\.self_attn\.o_proj\.weight_scale"),
    ("qwen3_moe", INT4_EXPERTS, r"model\.layers\.0\.mlp\.experts\.\d+\.down_proj\.weight_scale"),
], ids=IDS[:3])
def test_engine_logits_equal_transformers_on_independently_dequantized_weights(family, qc, wrong_scale):
    """Logits of the engine loaded with the quantized checkpoint equal transformers' from
    `from_pretrained` on weights dequantized outside megatron_sync.convert.quant (atol 1e-4: float32, another
    reduction order); negative control: the first scale of a weight (of every expert) off by 2x moves
    them far beyond that."""
    import re

    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.hf_check import hf_logits_from_checkpoint
    from tests.support.jobs import EVAL_TOKENS

    spec, config = tiny(family, qc)
    engine = ReferenceEngine(config, tp_rank=0, tp_size=1)
    quant = engine.converter.quant
    full = reference_checkpoint(engine.converter, unquantized_hf(family, spec))
    dequantized = {w: full[w] if quant.scheme_of(w) is None else independent_dequantize(w, full, quant.scheme_of(w))
                   for w in engine.converter.expected_hf_tensors(quantized=False)}
    hf = hf_logits_from_checkpoint(dequantized.items(), models.hf_config(spec), EVAL_TOKENS)
    assert not hf.problems
    engine.load_shards(full, 1)
    assert (engine.logits(EVAL_TOKENS) - hf.logits).abs().max().item() < 1e-4
    wrong = {n: t.clone() for n, t in full.items()}
    scales = [n for n in wrong if re.fullmatch(wrong_scale, n)]
    assert scales
    for name in scales:
        wrong[name].view(-1)[0] *= 2
    engine.load_shards(wrong, 2)
    assert (engine.logits(EVAL_TOKENS) - hf.logits).abs().max().item() > 1e-2


def test_engine_refuses_shards_that_disagree_with_its_quantized_layout():
    from megatron_sync.engines.reference.engine import ReferenceEngine

    spec, config = tiny("qwen3_moe", INT4_EXPERTS)
    engine = ReferenceEngine(config, tp_rank=0, tp_size=2)
    full = reference_checkpoint(engine.converter, unquantized_hf("qwen3_moe", spec))
    shards = {n: shard_of(engine, n, t).clone() for n, t in full.items()}
    scale = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    with pytest.raises(ValueError, match=scale.replace(".", r"\.")):
        engine.load_shards({n: t for n, t in shards.items() if n != scale}, 1)
    packed = "model.layers.0.mlp.experts.2.down_proj.weight_packed"
    with pytest.raises(ValueError, match=r"down_proj\.weight_packed: shard \(64, 8\) torch.int32 != this rank's \(64, 4\)"):
        engine.load_shards({**shards, packed: full[packed]}, 1)  # the whole weight's words, not this rank's
    assert engine.version == 0
    held = engine.rank_layout().by_name
    assert "model.layers.0.mlp.experts.2.up_proj.weight" not in held  # sent as packed words and scales
    assert held["model.layers.0.mlp.experts.2.down_proj.weight_shape"][0].source.sizes == (2,)  # whole


def test_engine_tp_that_cuts_a_scale_block_fails_at_construction_naming_the_setting():
    from megatron_sync.engines.reference.engine import ReferenceEngine

    config = tiny("deepseek_v3", {**FP8_BLOCK, "weight_block_size": [32, 32]})[1]  # q_b_proj: 48 rows per rank
    with pytest.raises(ValueError, match=r"q_b_proj\.weight.*weight_block_size"):
        ReferenceEngine(config, tp_rank=0, tp_size=2)
