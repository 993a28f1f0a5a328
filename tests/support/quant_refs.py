"""The quantizers engines ship, called as references: bit-level comparison helpers and thin wrappers.

- FP8 block: vLLM's `vllm.utils.deep_gemm.per_block_cast_to_fp8` (DeepGEMM's
  routine, eager, without its torch.compile wrapper).
- FP8 per-tensor: vLLM's `QuantFP8(static=False, PER_TENSOR).forward_native`.
- INT4: compressed-tensors' min-max group scales (`compute_dynamic_scales_and_zp`)
  and `PackedQuantizationCompressor.compress` / `.decompress`.
"""

from __future__ import annotations

import functools

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`, so that equality means bit-for-bit equality (NaN payloads, -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Assert equal dtype, shape and bytes; the message names `what` and how many bytes differ."""
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    differ = (bits(ours) != bits(ref)).sum().item()
    assert differ == 0, f"{what}: {differ} bytes differ"


@functools.lru_cache(maxsize=None)
def vllm_quantizers():
    """Return (vLLM's eager DeepGEMM block cast, vLLM's per-tensor QuantFP8); importing vLLM takes seconds."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.utils.deep_gemm import per_block_cast_to_fp8
    with set_current_vllm_config(VllmConfig()):
        per_tensor = QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR)
    # the plain routine: torch.compile's wrapper holds it, or torch.compile returned it as is (TORCHDYNAMO_DISABLE=1)
    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8), per_tensor


def ct_int4(group_size: int):
    """Return compressed-tensors' (QuantizationArgs, QuantizationScheme) of symmetric INT4 groups."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return args, QuantizationScheme(targets=["Linear"], weights=args)


def ct_compress(x: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """compressed-tensors end to end: min-max group scales, then its pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    args, scheme = ct_int4(group_size)
    scale, _ = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module())
    return PackedQuantizationCompressor.compress({"weight": x, "weight_scale": scale}, scheme)


def ct_decompress(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """compressed-tensors' decompression of {weight_packed, weight_scale, weight_shape} to the weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    return PackedQuantizationCompressor.decompress(tensors, ct_int4(group_size)[1])["weight"]


def reference_quantize(name: str, x: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """Return the checkpoint tensors the engines' own library makes of weight `name` = `x` under `scheme`
    (a `megatron_sync.convert.quant` scheme, read only for its settings), keyed by their checkpoint names."""
    from megatron_sync.convert.quant import Fp8Block, Fp8Tensor, Int4Group

    prefix = name.removesuffix("weight")
    if isinstance(scheme, Fp8Block):
        q, s = vllm_quantizers()[0](x, block_size=list(scheme.block), use_ue8m0=scheme.scale_fmt == "ue8m0")
        return {name: q, prefix + "weight_scale_inv": s}
    if isinstance(scheme, Fp8Tensor):
        q, s = vllm_quantizers()[1].forward_native(x)
        return {name: q, prefix + "weight_scale": s.reshape(())}
    assert isinstance(scheme, Int4Group), scheme
    return {prefix + key: t for key, t in ct_compress(x, scheme.group_size).items()}




def reference_checkpoint(converter, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the checkpoint the engines' libraries make of the unquantized HF tensors `hf`: each weight
    the converter's quantization plan selects quantized by `reference_quantize`, the rest as they are."""
    out = {}
    for name, x in hf.items():
        scheme = converter.quant.scheme_of(name)
        out.update({name: x} if scheme is None else reference_quantize(name, x, scheme))
    return out

# -- the formats' error bounds (derived in megatron_sync.convert/quant/fp8.py and int4.py) ---------------------

def fp8_bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """|x - dequant| <= 2**-4 |x| + 2**-10 s (half an e4m3 step, normal or subnormal), + fp32 slack."""
    return (2.0 ** -4 * x.abs() + 2.0 ** -10 * scale_full) * (1 + 2.0 ** -16)


def block_scale_full(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """The block scales repeated to the weight's shape (each element's own scale)."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def int4_bound(x: torch.Tensor, scale_full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s/2 (1 + u) + 2.01 u |x| with u the unit roundoff of `dtype` (x / s and q * s are computed in it)."""
    u = torch.finfo(dtype).eps / 2
    return scale_full * 0.5 * (1 + u) + 2.01 * u * x.abs()


def within_format_bound(name: str, x: torch.Tensor, tensors: dict[str, torch.Tensor], scheme) -> bool:
    """Return True if weight `name` = `x`, stored as `tensors` under `scheme`, dequantizes within its format's
    elementwise error bound."""
    from megatron_sync.convert.quant import Fp8Block, Fp8Tensor, dequantize

    prefix = name.removesuffix("weight")
    if isinstance(scheme, Fp8Block):
        bound = fp8_bound(x.float(), block_scale_full(tensors[prefix + "weight_scale_inv"], x.shape, scheme.block))
    elif isinstance(scheme, Fp8Tensor):
        bound = fp8_bound(x.float(), tensors[prefix + "weight_scale"].expand(x.shape))
    else:
        scale = tensors[prefix + "weight_scale"].double().repeat_interleave(scheme.group_size, 1)
        bound = int4_bound(x.double(), scale, x.dtype)
    error = (dequantize(name, tensors, scheme, torch.float64) - x.double()).abs()
    return bool((error <= bound).all())

# -- tiny quantized models (the tests' HF configs) -------------------------------------------------

FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
"""DeepSeek-V3's FP8 config with blocks small enough for the tiny models' TP=2 shards (non-square on purpose)."""

FP8_TENSOR = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
"""Per-tensor FP8 (no weight_block_size): one scale per weight."""

INT4_EXPERTS = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}}},
    # the router gates too: vLLM would quantize mlp.gate (a Linear) unless listed; the family keeps it float
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None, "sparsity_config": {},
}
"""Kimi-K2-style INT4 (W4A16, group 32): routed experts only; attention, dense and shared MLPs stay float."""

TINY_QUANTIZED_SPECS = {"deepseek_v3": {"family": "deepseek_v3", "moe_ffn_hidden_size": 64},
                        "qwen3_moe": {"family": "qwen3_moe", "moe_ffn_hidden_size": 64}}
"""ModelSpec arguments: expert FFN 64 so a TP=2 shard of down_proj's columns is one whole INT4 group of 32."""
