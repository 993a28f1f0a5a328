"""FP8 (float8_e4m3fn) weight quantization in the `quant_method: fp8` checkpoint format.

Two schemes, both as vLLM's `Fp8LinearMethod` loads them and with the rounding
of the routine that produces them on the engine side:

- `Fp8Block`: per-block scales, float32 `weight_scale_inv` of shape
  [ceil(out/bo), ceil(in/bi)] (DeepSeek-V3 / Qwen3-FP8 checkpoints). Rounding is
  DeepGEMM's `per_block_cast_to_fp8`, which vLLM ships in `vllm.utils.deep_gemm`
  and uses for its own online block quantization:
      s = max(amax(|block|), 1e-4) / 448        (float32)
      s = 2 ** ceil(log2(s))                     (scale_fmt "ue8m0" only)
      q = e4m3(clamp(x * (1 / s), -448, 448))    (round to nearest even)
  The partial blocks of a shape that is not a multiple of the block are
  quantized as if zero-padded. UE8M0 scales stay float32 on the wire (powers of
  two, as DeepSeek-V3.1 checkpoints store them); `.to(torch.float8_e8m0fnu)` is
  lossless for an engine that wants the byte form.
- `Fp8Tensor`: one float32 `weight_scale` of shape () (the AutoFP8 layout; vLLM
  also accepts compressed-tensors' [1]). Rounding is vLLM's `QuantFP8` native
  per-tensor path:
      s = max(amax(|x|) / 448, 1 / (448 * 512));  q = e4m3(clamp(x * reciprocal(s), -448, 448))

Where the libraries differ (each difference is shown by a test in tests/test_quant.py):
- compressed-tensors divides (`x / s`); vLLM/DeepGEMM multiply by the
  reciprocal. With the same scale they disagree by one e4m3 step on up to a
  few tenths of a percent of bf16 elements (block by block, depending on the
  scale), so each format follows the producer of its own ecosystem.
- transformers' `Fp8Quantize` computes the scale as 1 / (448 / amax), not
  amax / 448 (equal after UE8M0 rounding, which the tests check bit for bit,
  but not always in float format), writes 1.0 for a zero block, and leaves
  shapes that are not multiples of the block unquantized.
- Zero or tiny blocks: DeepGEMM floors amax at 1e-4; compressed-tensors
  replaces a zero scale by its dtype's eps. All dequantize a zero block to 0.

Dequantization is `q.float() * s` (the scale broadcast over its block), which
is what engines and compressed-tensors' `dequantize` compute. Error bound for
every element x of a block with scale s:
    |x - dequant(x)| <= 2**-4 * |x| + 2**-10 * s   (+ float32 rounding)
2**-4 |x| is half an e4m3 step (3 mantissa bits) in the normal range, 2**-10 s
half the subnormal step 2**-9; |x / s| never exceeds 448, UE8M0 included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megatron_sync.convert.quant.base import (
    abs_max, require_2d, require_float, row_chunks, weight_prefix,
)
from megatron_sync.core.meta import TensorMeta

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK_AMAX_FLOOR = 1e-4  # DeepGEMM's per_block_cast_to_fp8 clamp
TENSOR_SCALE_FLOOR = 1.0 / (FP8_MAX * 512.0)  # vLLM QuantFP8's minimum scaling factor
SCALE_FORMATS = ("float", "ue8m0")


def _padded_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Return `x` zero-padded to whole blocks, viewed as [rows_b, bo, cols_b, bi] (no copy when aligned)."""
    rows, cols = x.shape
    bo, bi = block
    rb, cb = -(-rows // bo), -(-cols // bi)
    if (rb * bo, cb * bi) != (rows, cols):
        padded = x.new_zeros(rb * bo, cb * bi)
        padded[:rows, :cols] = x
        x = padded
    return x.view(rb, bo, cb, bi)


@dataclass(frozen=True)
class Fp8Block:
    """Block-wise FP8: e4m3 weight + float32 `weight_scale_inv` per (bo x bi) block."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"

    def __post_init__(self):
        block = tuple(int(b) for b in self.block)
        if len(block) != 2 or min(block) <= 0:
            raise ValueError(f"weight_block_size must be two positive ints, got {self.block!r}")
        if self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {self.scale_fmt!r}")
        object.__setattr__(self, "block", block)

    def output_names(self, name: str) -> tuple[str, ...]:
        """Return the names `quantize` produces for weight `name`: the weight itself and its block scales."""
        return name, weight_prefix(name) + "weight_scale_inv"

    def outputs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[TensorMeta]:
        """Return the metadata of the tensors `quantize` produces for a weight of this shape."""
        rows, cols = require_2d(name, tuple(shape))
        require_float(name, dtype)
        bo, bi = self.block
        names = self.output_names(name)
        return [TensorMeta(names[0], (rows, cols), FP8),
                TensorMeta(names[1], (-(-rows // bo), -(-cols // bi)), torch.float32)]

    def logical_shape(self, name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """Return the [out, in] shape of the weight held by `tensors`."""
        return tuple(tensors[name].shape)

    def _scale(self, blocks: torch.Tensor) -> torch.Tensor:
        """Return the float32 scale of each block of a float32 [rb, bo, cb, bi] view, shaped [rb, 1, cb, 1]."""
        scale = abs_max(blocks, (1, 3), keepdim=True).clamp_(BLOCK_AMAX_FLOOR) / FP8_MAX
        return torch.pow(2.0, torch.ceil(torch.log2(scale))) if self.scale_fmt == "ue8m0" else scale

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Return [(name, e4m3 weight), (prefix.weight_scale_inv, float32 block scales)]."""
        rows, cols = require_2d(name, tuple(x.shape))
        require_float(name, x.dtype)
        x = x.contiguous()
        q = torch.empty(rows, cols, dtype=FP8, device=x.device)
        scales = []
        for r0, r1 in row_chunks(rows, cols, self.block[0]):
            # float32 throughout, as the reference's bf16 * float32 promotes (the upcast is exact)
            blocks = _padded_blocks(x[r0:r1].to(torch.float32, copy=True), self.block)
            scale = self._scale(blocks)
            scaled = blocks.mul_(1.0 / scale).clamp_(-FP8_MAX, FP8_MAX)
            q[r0:r1].copy_(scaled.view(-1, scaled.shape[2] * scaled.shape[3])[: r1 - r0, :cols])
            scales.append(scale.view(scale.shape[0], scale.shape[2]))
        return [(name, q), (weight_prefix(name) + "weight_scale_inv", torch.cat(scales))]

    def dequantize(self, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   shape: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Return the weight rebuilt from its e4m3 values and block scales, cast to `dtype` (the values
        carry the shape; `shape` is accepted for symmetry with INT4)."""
        q, scale = tensors[name], tensors[weight_prefix(name) + "weight_scale_inv"].float()
        rows, cols = q.shape
        (bo, bi), (rb, cb) = self.block, scale.shape
        if (rows, cols) == (rb * bo, cb * bi):
            return q.view(rb, bo, cb, bi).float().mul_(scale.view(rb, 1, cb, 1)).view(rows, cols).to(dtype)
        full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
        return (q.float() * full).to(dtype)

    def output_units(self, name: str) -> dict[str, Optional[tuple[int, int]]]:
        """Return, per output of weight `name`, the weight elements one of its elements covers along each dim
        (the e4m3 values 1:1, a block scale one block); a shard edge must fall on a block edge."""
        weight, scale = self.output_names(name)
        return {weight: (1, 1), scale: self.block}


@dataclass(frozen=True)
class Fp8Tensor:
    """Per-tensor FP8: e4m3 weight + one float32 `weight_scale` of shape ()."""

    def output_names(self, name: str) -> tuple[str, ...]:
        """Return the names `quantize` produces for weight `name`: the weight itself and its scale."""
        return name, weight_prefix(name) + "weight_scale"

    def outputs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[TensorMeta]:
        """Return the metadata of the tensors `quantize` produces for a weight of this shape."""
        rows, cols = require_2d(name, tuple(shape))
        require_float(name, dtype)
        names = self.output_names(name)
        return [TensorMeta(names[0], (rows, cols), FP8), TensorMeta(names[1], (), torch.float32)]

    def logical_shape(self, name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """Return the [out, in] shape of the weight held by `tensors`."""
        return tuple(tensors[name].shape)

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Return [(name, e4m3 weight), (prefix.weight_scale, float32 scalar)]."""
        rows, cols = require_2d(name, tuple(x.shape))
        require_float(name, x.dtype)
        x = x.contiguous()
        scale = (abs_max(x, None).float() / FP8_MAX).clamp(min=TENSOR_SCALE_FLOOR)
        inverse = scale.reciprocal()
        q = torch.empty(rows, cols, dtype=FP8, device=x.device)
        for r0, r1 in row_chunks(rows, cols, 1):
            q[r0:r1].copy_(x[r0:r1].to(torch.float32, copy=True).mul_(inverse).clamp_(-FP8_MAX, FP8_MAX))
        return [(name, q), (weight_prefix(name) + "weight_scale", scale)]

    def dequantize(self, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   shape: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Return the weight rebuilt from its e4m3 values and its scale, cast to `dtype`."""
        return (tensors[name].float() * tensors[weight_prefix(name) + "weight_scale"].float()).to(dtype)

    def output_units(self, name: str) -> dict[str, Optional[tuple[int, int]]]:
        """Return, per output of weight `name`, the weight elements one of its elements covers along each dim:
        the e4m3 values 1:1; the scale, shared by every shard, None (held whole)."""
        weight, scale = self.output_names(name)
        return {weight: (1, 1), scale: None}
