"""Quantization core (megatron_sync.convert/quant): bit-for-bit against the libraries engines ship, plus bounds.

References, called directly from the installed packages:
- FP8 block: vLLM's `vllm.utils.deep_gemm.per_block_cast_to_fp8` (DeepGEMM's
  routine, eager, without its torch.compile wrapper); UE8M0 also against
  transformers' `Fp8Quantize`.
- FP8 per-tensor: vLLM's `QuantFP8(static=False, PER_TENSOR).forward_native`.
- INT4: compressed-tensors' `compute_dynamic_scales_and_zp` (the min-max scale)
  and `PackedQuantizationCompressor.compress` / `.decompress`.
- Targets: compressed-tensors' `is_match` and vLLM's `find_matched_target` /
  `should_ignore_layer` / `is_layer_skipped`; configs: vLLM's `Fp8Config` and
  compressed-tensors' `QuantizationConfig`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.convert import get_converter
from megatron_sync.convert.quant import (
    DEFAULT_UNQUANTIZED, Fp8Block, Fp8Tensor, Int4Group, QuantPlan, dequantize, pack_int4,
    parse_quantization_config, quantize, quantized_names, select_targets, shard_quantized, slice_quantized,
    unpack_int4,
)
from tests.support.quant_refs import (
    assert_bits_equal, bits, block_scale_full, ct_compress, ct_decompress, fp8_bound, int4_bound, vllm_quantizers,
)


# -- helpers ------------------------------------------------------------------------------------

def weight(shape, dtype, seed=0, *, special=False) -> torch.Tensor:
    """Random N(0,1) weights; `special` adds an all-zero block, a tiny block (< 1e-4) and huge spikes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if special:
        rows, cols = shape
        x[: min(rows, 128), : min(cols, 128)] = 0.0                      # an all-zero block
        x[rows // 2:, cols // 2:] *= 1e-6                                # tiny block(s): DeepGEMM's amax floor
        x[-1, 0], x[0, -1] = 7.0e4, -3.0e30                              # far beyond e4m3's 448
    return x.to(dtype)


@pytest.fixture(scope="module")
def vllm_refs():
    """vLLM's block cast (eager) and per-tensor QuantFP8; importing vLLM takes a few seconds."""
    return vllm_quantizers()


FP8_SHAPES = [(256, 384), (300, 260), (1, 1), (129, 511)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


# -- FP8 block ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_block_equals_vllm_deepgemm_cast(vllm_refs, shape, dtype, block, scale_fmt):
    block_cast, _ = vllm_refs
    special = dtype != torch.float16  # fp16 cannot hold the 3e30 spike
    x = weight(shape, dtype, special=special)
    out = dict(quantize("m.weight", x, Fp8Block(block, scale_fmt)))
    ref_q, ref_s = block_cast(x, block_size=list(block), use_ue8m0=scale_fmt == "ue8m0")
    assert_bits_equal(out["m.weight"], ref_q, "e4m3 weight")
    assert_bits_equal(out["m.weight_scale_inv"], ref_s, "weight_scale_inv")
    assert [(n, tuple(t.shape), t.dtype) for n, t in out.items()] == quantized_names("m.weight", shape, dtype,
                                                                                     Fp8Block(block, scale_fmt))


@pytest.mark.parametrize("shape", [(256, 384), (384, 128)])
def test_fp8_block_ue8m0_equals_transformers_fp8quantize(shape):
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config
    x = weight(shape, torch.bfloat16, seed=3)
    x[:128, :128] *= 0  # a zero block; transformers writes scale 1.0 there, as our UE8M0 floor does not
    hf = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128), scale_fmt="ue8m0"))
    ref = Fp8Quantize(hf).convert({"m.weight": x})
    out = dict(quantize("m.weight", x, Fp8Block((128, 128), "ue8m0")))
    assert_bits_equal(out["m.weight"], ref["m.weight"], "e4m3 weight")
    nonzero = ref["m.weight_scale_inv"].float() != 1.0
    assert_bits_equal(out["m.weight_scale_inv"][nonzero], ref["m.weight_scale_inv"].float()[nonzero], "scales")
    lossless = out["m.weight_scale_inv"].to(torch.float8_e8m0fnu).float()
    assert_bits_equal(lossless, out["m.weight_scale_inv"], "float32 UE8M0 scales survive a cast to e8m0")


def test_fp8_division_convention_of_compressed_tensors_differs_by_one_step():
    """compressed-tensors divides by the scale, DeepGEMM/vLLM multiply by its reciprocal: with the same
    scale, at most one e4m3 code apart on a small fraction of elements (why each format keeps its own)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    x = (weight((512, 512), torch.float32, seed=2) * 0.37).to(torch.bfloat16)  # whether a block differs
    ours = dict(quantize("m.weight", x, Fp8Block()))
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128])
    ref = ct_quantize(x, ours["m.weight_scale_inv"], None, args, dtype=torch.float8_e4m3fn)
    codes = ours["m.weight"].view(torch.int8).int(), ref.view(torch.int8).int()
    differ = (codes[0] != codes[1])
    assert 0 < differ.float().mean().item() < 1e-2  # depends on the block's scale; 0.2% here
    assert (codes[0] - codes[1]).abs().max().item() == 1


# -- FP8 per-tensor -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("content", ["normal", "special", "zero", "tiny"])
def test_fp8_tensor_equals_vllm_quantfp8(vllm_refs, shape, dtype, content):
    _, per_tensor = vllm_refs
    x = weight(shape, dtype, special=content == "special" and dtype != torch.float16)
    x = {"zero": x * 0, "tiny": x * 1e-5}.get(content, x)  # both hit vLLM's minimum scale
    out = dict(quantize("m.weight", x, Fp8Tensor()))
    ref_q, ref_s = per_tensor.forward_native(x)
    assert_bits_equal(out["m.weight"], ref_q, "e4m3 weight")
    assert_bits_equal(out["m.weight_scale"].reshape(1), ref_s, "weight_scale")
    assert out["m.weight_scale"].shape == ()  # AutoFP8's layout; vLLM also loads compressed-tensors' [1]


# -- FP8 error bound ----------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", [Fp8Block(), Fp8Block((128, 128), "ue8m0"), Fp8Block((32, 64)), Fp8Tensor()])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special", [False, True])
def test_fp8_dequantized_error_within_bound(scheme, dtype, special):
    x = weight((300, 260), dtype, seed=7, special=special)
    out = dict(quantize("m.weight", x, scheme))
    x32 = x.float()
    if isinstance(scheme, Fp8Block):
        s = block_scale_full(out["m.weight_scale_inv"], x.shape, scheme.block)
    else:
        s = out["m.weight_scale"].expand_as(x32)
    err = (dequantize("m.weight", out, scheme) - x32).abs()
    ratio = err / fp8_bound(x32, s)
    assert ratio.max().item() <= 1.0
    if not special:  # (a 3e30 spike flushes a whole tensor's other values to zero, far inside the bound)
        assert ratio.max().item() > 0.5  # the bound is tight, so a broken quantizer would exceed it


def test_fp8_bound_check_catches_a_wrong_scale():
    """Negative control: the same check on a scale off by 12.5% in one block fails."""
    x = weight((256, 256), torch.float32, seed=8)
    out = dict(quantize("m.weight", x, Fp8Block()))
    out["m.weight_scale_inv"] = out["m.weight_scale_inv"].clone()
    out["m.weight_scale_inv"][1, 0] *= 1.125
    s = block_scale_full(out["m.weight_scale_inv"], x.shape, (128, 128))
    err = (dequantize("m.weight", out, Fp8Block()) - x).abs()
    assert (err > fp8_bound(x, s)).any()


def test_bitwise_check_catches_one_ulp_scale_change(vllm_refs):
    """Negative control: one ulp on one block scale is a failure of the bit-for-bit comparison."""
    block_cast, _ = vllm_refs
    x = weight((256, 256), torch.bfloat16, seed=9)
    out = dict(quantize("m.weight", x, Fp8Block()))
    _, ref_s = block_cast(x, block_size=[128, 128], use_ue8m0=False)
    perturbed = out["m.weight_scale_inv"].clone()
    perturbed.view(torch.int32)[0, 1] += 1
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_bits_equal(perturbed, ref_s, "weight_scale_inv")


# -- INT4 pack-quantized ------------------------------------------------------------------------

INT4_CASES = [((64, 256), 32), ((64, 256), 128), ((100, 384), 128), ((7, 96), 32), ((3, 32), 32)]


@pytest.mark.parametrize("shape,group_size", INT4_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("special", [False, True])
def test_int4_equals_compressed_tensors_compressor(shape, group_size, dtype, special):
    x = weight(shape, dtype, seed=11, special=special and dtype != torch.float16)
    scheme = Int4Group(group_size)
    out = dict(quantize("m.weight", x, scheme))
    ref = ct_compress(x, group_size)
    assert sorted(ref) == ["weight_packed", "weight_scale", "weight_shape"]
    for key in ref:
        assert_bits_equal(out["m." + key], ref[key], key)
    metas = [(n, tuple(t.shape), t.dtype) for n, t in out.items()]
    assert metas == quantized_names("m.weight", shape, dtype, scheme)
    local = {k.removeprefix("m."): v for k, v in out.items()}
    assert_bits_equal(dequantize("m.weight", out, scheme, dtype), ct_decompress(local, group_size), "decompressed")


@pytest.mark.parametrize("cols", [8, 16, 40, 5, 13])
def test_pack_int4_equals_compressed_tensors_pack_to_int32(cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-8, 8, (6, cols), generator=g, dtype=torch.int8)
    q[0, : min(cols, 8)] = 7  # the top nibble of a word set: the int32 sign bit
    assert_bits_equal(pack_int4(q), pack_to_int32(q, 4), "packed words")
    assert_bits_equal(unpack_int4(pack_int4(q), cols), q, "round trip")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_dequantized_error_within_bound(dtype, group_size):
    x = weight((96, 512), dtype, seed=12)
    out = dict(quantize("m.weight", x, Int4Group(group_size)))
    s = out["m.weight_scale"].double().repeat_interleave(group_size, 1)
    err = (dequantize("m.weight", out, Int4Group(group_size), torch.float64) - x.double()).abs()
    ratio = err / int4_bound(x.double(), s, dtype)
    assert ratio.max().item() <= 1.0
    assert ratio.max().item() > 0.9


def test_int4_flipped_nibble_is_detected():
    """Negative control: one changed 4-bit value shows in the compressed-tensors decompression."""
    x = weight((16, 64), torch.bfloat16, seed=13)
    out = dict(quantize("m.weight", x, Int4Group(32)))
    local = {k.removeprefix("m."): v.clone() for k, v in out.items()}
    local["weight_packed"][3, 1] ^= 0x10  # column 9 of row 3
    theirs = ct_decompress(local, 32)
    ours = dequantize("m.weight", out, Int4Group(32), torch.bfloat16)
    assert (bits(theirs) != bits(ours)).any()
    assert torch.nonzero(theirs != ours).tolist() == [[3, 9]]


# -- which weights: configs, targets, family defaults -------------------------------------------

# Quantizable DeepSeek-V3: every Linear input width is a multiple of 32.
DSV3 = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1, tie_word_embeddings=False)
QWEN3_MOE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)

DEEPSEEK_V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
KIMI_K2_INT4 = {  # the shape of moonshotai/Kimi-K2-Thinking's config: only routed experts are INT4
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "sparsity_config": {},
}


def is_linear_weight(name: str) -> bool:
    """The Linear weights of these families, as vLLM builds them (its router gate is a Linear too)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight", "mlp.gate.weight")) or name == "lm_head.weight"


def layout(family: str, cfg: dict) -> dict:
    return get_converter(family, cfg).expected_hf_tensors()


def test_deepseek_v3_fp8_quantizes_every_projection_but_not_router_or_lm_head():
    names = layout("deepseek_v3", DSV3)
    plan = QuantPlan.from_hf_config(DEEPSEEK_V3_FP8, names, is_linear_weight)
    projections = {n for n in names if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))}
    assert set(plan.schemes) == projections
    assert set(plan.schemes.values()) == {Fp8Block((128, 128), "float")}
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight"):
        assert kept in names and plan.scheme_of(kept) is None


def test_fp8_ignore_list_matches_exact_module_names_as_vllm():
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    names = layout("qwen3_moe", QWEN3_MOE)
    ignore = ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.self_attn.o_proj", "k_proj"]
    cfg = dict(DEEPSEEK_V3_FP8, modules_to_not_convert=ignore)
    chosen = select_targets(parse_quantization_config(cfg), names, is_linear_weight, keep_unquantized=())
    for name in filter(is_linear_weight, names):
        assert (name in chosen) == (not is_layer_skipped(name.removesuffix(".weight"), ignore)), name
    assert "model.layers.1.self_attn.k_proj.weight" in chosen  # "k_proj" is not a module name: no suffix match


def vllm_ct_group(module: str, cfg: dict) -> str | None:
    """vLLM's compressed-tensors choice for a Linear module: ignore first, then its first matching target."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        find_matched_target, should_ignore_layer,
    )
    if should_ignore_layer(module, ignore=cfg.get("ignore") or []):
        return None
    groups = cfg["config_groups"]
    target = find_matched_target(module, torch.nn.Linear(1, 1), [t for g in groups.values() for t in g["targets"]])
    return next((g for g, group in groups.items() if target in group["targets"]), None)


def test_kimi_style_int4_quantizes_routed_experts_only_as_vllm_and_compressed_tensors_match():
    from compressed_tensors.utils.match import is_match
    names = layout("deepseek_v3", DSV3)
    chosen = select_targets(parse_quantization_config(KIMI_K2_INT4), names, is_linear_weight, keep_unquantized=())
    group = KIMI_K2_INT4["config_groups"]["group_0"]
    for name in filter(is_linear_weight, names):
        module = name.removesuffix(".weight")
        assert (name in chosen) == (vllm_ct_group(module, KIMI_K2_INT4) == "group_0"), name
        linear = torch.nn.Linear(1, 1)
        assert (name in chosen) == is_match(module, linear, group["targets"], KIMI_K2_INT4["ignore"])
    plan = QuantPlan.from_hf_config(KIMI_K2_INT4, names, is_linear_weight)  # + the defaults: no router gate
    assert set(plan.schemes) == {n for n in names if ".mlp.experts." in n}
    assert set(plan.schemes.values()) == {Int4Group(32)}


def test_compressed_tensors_name_target_wins_over_linear_class_as_in_vllm():
    cfg = dict(KIMI_K2_INT4, ignore=["lm_head"], config_groups={
        "linear": dict(KIMI_K2_INT4["config_groups"]["group_0"], targets=["Linear"]),
        "experts": dict(KIMI_K2_INT4["config_groups"]["group_0"], targets=["re:.*mlp\\.experts\\..*"],
                        weights=dict(KIMI_K2_INT4["config_groups"]["group_0"]["weights"], group_size=16))})
    names = layout("deepseek_v3", DSV3)
    chosen = select_targets(parse_quantization_config(cfg), names, is_linear_weight, keep_unquantized=())
    by_size = {32: "linear", 16: "experts"}
    for name in filter(is_linear_weight, names):
        expected = vllm_ct_group(name.removesuffix(".weight"), cfg)
        assert (by_size[chosen[name].group_size] if name in chosen else None) == expected, name
    assert chosen["model.layers.1.mlp.experts.0.up_proj.weight"] == Int4Group(16)


def test_family_defaults_stay_unquantized_whatever_the_config_says():
    cfg = dict(KIMI_K2_INT4, ignore=[])  # targets every Linear, router gate and lm_head included
    names = layout("deepseek_v3", DSV3)
    plan = QuantPlan.from_hf_config(cfg, names, is_linear_weight)
    assert "model.layers.1.mlp.gate.weight" not in plan.schemes and "lm_head.weight" not in plan.schemes
    everything = select_targets(parse_quantization_config(cfg), names, is_linear_weight, keep_unquantized=())
    assert set(everything) - set(plan.schemes) == {"lm_head.weight", "model.layers.1.mlp.gate.weight",
                                                   "model.layers.2.mlp.gate.weight"}
    assert "model.layers.{layer}.mlp.gate.weight" in DEFAULT_UNQUANTIZED  # anchored: gate_proj stays targeted
    assert "model.layers.0.mlp.gate_proj.weight" in plan.schemes


def test_parsed_configs_agree_with_vllm_and_compressed_tensors_parsers():
    from compressed_tensors.quantization import QuantizationConfig
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    per_tensor = dict(DEEPSEEK_V3_FP8, weight_block_size=None, modules_to_not_convert=["lm_head"])
    for cfg in (DEEPSEEK_V3_FP8, per_tensor):
        ours, theirs = parse_quantization_config(cfg), Fp8Config.from_config(cfg)
        scheme = ours.groups[0].scheme
        assert (list(scheme.block) if isinstance(scheme, Fp8Block) else None) == theirs.weight_block_size
        assert list(ours.ignore) == theirs.ignored_layers
    ours, theirs = parse_quantization_config(KIMI_K2_INT4), QuantizationConfig.model_validate(KIMI_K2_INT4)
    assert ours.groups[0].scheme.group_size == theirs.config_groups["group_0"].weights.group_size
    assert list(ours.groups[0].targets) == theirs.config_groups["group_0"].targets
    assert list(ours.ignore) == theirs.ignore


def _with(base: dict, path: str, value) -> dict:
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    if path.startswith("w."):
        group = dict(cfg["config_groups"]["group_0"])
        group["weights"] = dict(group["weights"], **{path[2:]: value})
        cfg["config_groups"] = {"group_0": group}
    elif path.startswith("g."):
        cfg["config_groups"] = {"group_0": dict(cfg["config_groups"]["group_0"], **{path[2:]: value})}
    else:
        cfg[path] = value
    return cfg


@pytest.mark.parametrize("cfg,message", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    (_with(DEEPSEEK_V3_FP8, "fmt", "e5m2"), "fmt='e5m2'"),
    (_with(DEEPSEEK_V3_FP8, "activation_scheme", "static"), "activation_scheme='static'"),
    (_with(DEEPSEEK_V3_FP8, "scale_fmt", "e8m0"), "scale_fmt='e8m0'"),
    (_with(_with(DEEPSEEK_V3_FP8, "weight_block_size", None), "scale_fmt", "ue8m0"), "scale_fmt='ue8m0'"),
    (_with(DEEPSEEK_V3_FP8, "weight_block_size", [128]), "weight_block_size"),
    (_with(DEEPSEEK_V3_FP8, "modules_to_not_convert", ["re:.*gate"]), "exact module names"),
    (_with(KIMI_K2_INT4, "format", "float-quantized"), "format='float-quantized'"),
    (_with(KIMI_K2_INT4, "w.num_bits", 8), "weights.num_bits=8"),
    (_with(KIMI_K2_INT4, "w.symmetric", False), "weights.symmetric=False"),
    (_with(KIMI_K2_INT4, "w.actorder", "group"), "weights.actorder='group'"),
    (_with(KIMI_K2_INT4, "w.group_size", None), "weights.group_size"),
    (_with(KIMI_K2_INT4, "g.input_activations", {"num_bits": 8}), "input_activations must be null"),
    (_with(KIMI_K2_INT4, "g.targets", ["Embedding"]), "'Embedding' names a module class"),
    (_with(KIMI_K2_INT4, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
    (_with(KIMI_K2_INT4, "config_groups", {}), "config_groups"),
])
def test_unsupported_config_raises_naming_the_key(cfg, message):
    with pytest.raises(ValueError, match="quantization_config") as e:
        parse_quantization_config(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize("scheme,name,tensor,message", [
    (Int4Group(128), "m.weight", torch.zeros(4, 96), "group_size=128"),
    (Fp8Block(), "m.weight", torch.zeros(8), "2-D"),
    (Fp8Tensor(), "m.bias", torch.zeros(4, 4), "'.weight'"),
    (Int4Group(32), "m.weight", torch.zeros(4, 32, dtype=torch.int32), "dtype torch.int32"),
])
def test_unquantizable_tensor_raises_naming_it(scheme, name, tensor, message):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        quantize(name, tensor, scheme)
    assert message in str(e.value)


# -- TP slicing of a weight with its scales -----------------------------------------------------

SHARD_SCHEMES = [Fp8Block(), Fp8Block((64, 32), "ue8m0"), Fp8Tensor(), Int4Group(32), Int4Group(128)]


@pytest.mark.parametrize("scheme", SHARD_SCHEMES)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_keeps_scales_with_their_rows_and_cols(scheme, dim, world):
    x = weight((768, 768), torch.bfloat16, seed=21)
    full = dict(quantize("m.weight", x, scheme))
    whole = dequantize("m.weight", full, scheme)
    chunk = 768 // world
    for rank in range(world):
        shard = shard_quantized("m.weight", full, scheme, dim, rank, world)
        assert set(shard) == set(full)
        local = tuple(whole.narrow(dim, rank * chunk, chunk).shape)
        rebuilt = dequantize("m.weight", shard, scheme, shape=local)
        assert_bits_equal(rebuilt, whole.narrow(dim, rank * chunk, chunk), f"rank {rank} dequantized")
        if not isinstance(scheme, Fp8Tensor):  # block-local scales: the shard is the shard's own quantization
            own = dict(quantize("m.weight", x.narrow(dim, rank * chunk, chunk).contiguous(), scheme))
            for name in full:
                if name.endswith("weight_shape"):  # held whole, as vLLM loads it: the whole weight's shape
                    assert shard[name].tolist() == [768, 768]
                    continue
                assert_bits_equal(shard[name].contiguous(), own[name], f"rank {rank} {name}")


def test_slice_of_ragged_last_block_takes_the_partial_scale_block():
    x = weight((300, 260), torch.float32, seed=22)
    full = dict(quantize("m.weight", x, Fp8Block()))
    part = slice_quantized("m.weight", full, Fp8Block(), 0, 256, 300)
    assert part["m.weight_scale_inv"].shape == (1, 3)
    assert_bits_equal(dequantize("m.weight", part, Fp8Block()),
                      dequantize("m.weight", full, Fp8Block())[256:300], "last block rows")


@pytest.mark.parametrize("scheme,shape,dim,world,setting", [
    (Fp8Block(), (384, 256), 0, 2, "weight_block_size"),
    (Fp8Block((64, 128)), (256, 384), 1, 2, "weight_block_size"),
    (Int4Group(128), (64, 384), 1, 2, "group_size"),
    (Int4Group(32), (64, 192), 1, 4, "group_size"),
    (Int4Group(4), (8, 24), 1, 6, "group_size"),  # whole groups, but 4 columns split an int32 word
])
def test_shard_edge_inside_a_block_or_group_raises_naming_the_setting(scheme, shape, dim, world, setting):
    full = dict(quantize("m.weight", weight(shape, torch.bfloat16), scheme))
    with pytest.raises(ValueError, match=setting) as e:
        shard_quantized("m.weight", full, scheme, dim, 1, world)
    assert "'m.weight" in str(e.value) and f"dim {dim}" in str(e.value)


def test_shard_into_unequal_chunks_raises():
    full = dict(quantize("m.weight", weight((512, 256), torch.bfloat16), Fp8Tensor()))
    with pytest.raises(ValueError, match="does not split into 3 equal shards"):
        shard_quantized("m.weight", full, Fp8Tensor(), 0, 0, 3)


# -- the converter's view: expected layout, reverse lookup, buckets -----------------------------

@pytest.mark.parametrize("cfg", [DEEPSEEK_V3_FP8, dict(DEEPSEEK_V3_FP8, weight_block_size=None), KIMI_K2_INT4,
                                 dict(DEEPSEEK_V3_FP8, scale_fmt="ue8m0")])
def test_expected_layout_is_what_quantize_produces(cfg):
    hf = layout("deepseek_v3", DSV3)
    plan = QuantPlan.from_hf_config(cfg, hf, is_linear_weight)
    produced = {}
    for i, (name, (shape, dtype)) in enumerate(hf.items()):
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)
        for out, t in plan.quantize(name, tensor):
            assert out not in produced
            produced[out] = (tuple(t.shape), t.dtype)
            assert plan.weight_of(out) == (name if name in plan.schemes else None)
    assert produced == plan.expected_layout(hf)


def test_expected_layout_rejects_a_plan_built_from_other_names():
    plan = QuantPlan({"model.layers.9.mlp.down_proj.weight": Int4Group(32)})
    with pytest.raises(ValueError, match="not in the expected HF layout"):
        plan.expected_layout(layout("deepseek_v3", DSV3))


@pytest.mark.parametrize("cfg", [DEEPSEEK_V3_FP8, KIMI_K2_INT4, dict(DEEPSEEK_V3_FP8, weight_block_size=None)])
def test_keep_together_puts_every_weight_in_its_scales_bucket(cfg):
    from megatron_sync.plan.buckets import build_plan
    hf = layout("deepseek_v3", DSV3)
    plan = QuantPlan.from_hf_config(cfg, hf, is_linear_weight)
    metas = [m for name, (shape, dtype) in hf.items() for m in plan.outputs(name, shape, dtype)]
    sync = build_plan([metas], bucket_size_bytes=2048, keep_together=plan.keep_together())
    bucket_of = {e.name: b.index for b in sync.buckets for e in b.entries}
    assert len(sync.buckets) > 10  # small buckets, so separation would show
    for name, scheme in plan.schemes.items():
        assert len({bucket_of[out] for out in scheme.output_names(name)}) == 1, name


# -- inputs the convert stage may hand over ------------------------------------------------------

@pytest.mark.parametrize("scheme", SHARD_SCHEMES)
def test_non_contiguous_source_quantizes_like_its_contiguous_copy(scheme):
    x = weight((256, 512), torch.bfloat16, seed=30)
    strided = x.t().contiguous().t()
    assert not strided.is_contiguous()
    for (n1, a), (n2, b) in zip(quantize("m.weight", strided, scheme), quantize("m.weight", x, scheme)):
        assert n1 == n2
        assert_bits_equal(a, b, n1)


@pytest.mark.parametrize("scheme,shape", [(Fp8Block(), (300, 260)), (Fp8Block((64, 32), "ue8m0"), (300, 260)),
                                          (Fp8Tensor(), (300, 260)), (Int4Group(32), (300, 384))])
def test_many_row_chunks_equal_the_reference(vllm_refs, monkeypatch, scheme, shape):
    """Large weights are quantized in row chunks; force many (and a ragged last one) on a small weight."""
    import megatron_sync.convert.quant.base as base
    monkeypatch.setattr(base, "CHUNK_ELEMS", 5000)
    assert len(base.row_chunks(shape[0], shape[1], 64)) > 3
    x = weight(shape, torch.bfloat16, seed=31, special=True)
    out = dict(quantize("m.weight", x, scheme))
    block_cast, per_tensor = vllm_refs
    if isinstance(scheme, Fp8Block):
        ref = block_cast(x, block_size=list(scheme.block), use_ue8m0=scheme.scale_fmt == "ue8m0")
        ref = {"m.weight": ref[0], "m.weight_scale_inv": ref[1]}
    elif isinstance(scheme, Fp8Tensor):
        ref = dict(zip(("m.weight", "m.weight_scale"), per_tensor.forward_native(x)))
        ref["m.weight_scale"] = ref["m.weight_scale"].reshape(())
    else:
        ref = {"m." + k: v for k, v in ct_compress(x, scheme.group_size).items()}
    assert sorted(out) == sorted(ref)
    for name in out:
        assert_bits_equal(out[name], ref[name], name)
