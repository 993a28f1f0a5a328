"""INT4 weight-only, group-wise, symmetric quantization in compressed-tensors' `pack-quantized` format.

Checkpoint layout (what vLLM's `CompressedTensorsWNA16` and compressed-tensors'
`PackedQuantizationCompressor` load), for a weight [out, in] and group size g:
- `weight_packed`: int32 [out, ceil(in/8)]; word j of a row holds columns
  8j..8j+7, column 8j+k in bits 4k..4k+3, stored as q + 8 (unsigned 0..15).
- `weight_scale`: [out, in/g] in the weight's own dtype (compressed-tensors
  gives the scale the observed weight's dtype: bf16 for a bf16 model; sources
  are float32, bfloat16 or float16).
- `weight_shape`: int64 [2], the logical [out, in].
No zero point (symmetric). The rounding is compressed-tensors' own
(`calculate_qparams` from the group min/max, then `quantize`), all in the
weight's dtype, as llm-compressor's min-max observer runs it:
    s = max(|x|) over the group / 7.5;  s = eps(dtype) where s == 0
    q = round_half_even(clamp(x / s, -8, 7))
Dequantization: q * s in the scale dtype.
Error bound per element, with u the unit roundoff of the dtype (2**-8 for
bf16, 2**-24 for fp32): |x - dequant(x)| <= s/2 * (1 + u) + 2.01 * u * |x|
(s/2 from rounding to the integer grid, including the clamp of +7.5 s to +7;
the u terms from computing x / s and q * s in that dtype).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megatron_sync.convert.quant.base import (
    abs_max, require_2d, require_float, row_chunks, weight_prefix,
)
from megatron_sync.core.meta import TensorMeta

PACK = 8  # 4-bit values per int32 word
QMIN, QMAX = -8, 7
SCALE_DIVISOR = (QMAX - QMIN) / 2  # 7.5, compressed-tensors' symmetric range
_SETTING = "config_groups.<group>.weights.group_size"

assert sys.byteorder == "little", "pack_int4 builds int32 words from bytes in little-endian order"


def _pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Return uint8 values 0..15 of shape [rows, cols] (cols a multiple of 8) packed into int32 words."""
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(torch.int32)


def _padded_to_words(values: torch.Tensor) -> torch.Tensor:
    """Return float values 0..15 as uint8, zero-padded to whole 8-value words (no padding copy when aligned)."""
    rows, cols = values.shape
    if cols % PACK == 0:
        return values.to(torch.uint8)
    nibbles = torch.zeros(rows, -(-cols // PACK) * PACK, dtype=torch.uint8, device=values.device)
    nibbles[:, :cols] = values
    return nibbles


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Return int8 values in [-8, 7] of shape [rows, cols] packed into int32 [rows, ceil(cols/8)]."""
    rows, cols = q.shape
    padded = -(-cols // PACK) * PACK
    padded_q = torch.full((rows, padded), -8, dtype=torch.int8, device=q.device)  # pads as zero bits
    padded_q[:, :cols] = q
    return _pack_nibbles((padded_q + 8).view(torch.uint8))


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Return the int8 values in [-8, 7] of shape [rows, cols] held by `pack_int4`'s int32 words."""
    pairs = packed.contiguous().view(torch.uint8)
    nibbles = torch.stack((pairs & 0xF, pairs >> 4), dim=-1).view(pairs.shape[0], -1)
    return nibbles[:, :cols].to(torch.int8) - 8


@dataclass(frozen=True)
class Int4Group:
    """Symmetric INT4 groups of `group_size` input columns, packed eight to an int32."""

    group_size: int = 128

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")

    def _groups(self, name: str, cols: int) -> int:
        if cols % self.group_size:
            raise ValueError(
                f"{name!r} has {cols} input columns, not a multiple of group_size={self.group_size}; "
                f"change {_SETTING} or add the module to the config's ignore list"
            )
        return cols // self.group_size

    def output_names(self, name: str) -> tuple[str, ...]:
        """Return the names `quantize` produces for weight `name`: packed values, scales, logical shape."""
        prefix = weight_prefix(name)
        return prefix + "weight_packed", prefix + "weight_scale", prefix + "weight_shape"

    def outputs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[TensorMeta]:
        """Return the metadata of the tensors `quantize` produces for a weight of this shape and dtype."""
        rows, cols = require_2d(name, tuple(shape))
        require_float(name, dtype)
        packed, scale, logical = self.output_names(name)
        return [TensorMeta(packed, (rows, -(-cols // PACK)), torch.int32),
                TensorMeta(scale, (rows, self._groups(name, cols)), dtype),
                TensorMeta(logical, (2,), torch.int64)]

    def logical_shape(self, name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """Return the [out, in] shape of the weight held by `tensors` (its `weight_shape`)."""
        rows, cols = (int(v) for v in tensors[weight_prefix(name) + "weight_shape"].tolist())
        return rows, cols

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Return [(prefix.weight_packed, int32), (prefix.weight_scale, x.dtype), (prefix.weight_shape, int64)]."""
        rows, cols = require_2d(name, tuple(x.shape))
        require_float(name, x.dtype)
        groups = x.contiguous().view(rows, self._groups(name, cols), self.group_size)
        packed = torch.empty(rows, -(-cols // PACK), dtype=torch.int32, device=x.device)
        scales = []
        for r0, r1 in row_chunks(rows, cols, 1):
            scale, nibbles = self._quantize_rows(groups[r0:r1])
            packed[r0:r1] = _pack_nibbles(_padded_to_words(nibbles.view(r1 - r0, cols)))
            scales.append(scale)
        logical = torch.tensor([rows, cols], dtype=torch.int64, device=x.device)
        return list(zip(self.output_names(name), (packed, torch.cat(scales), logical)))

    def _quantize_rows(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (scales, q + 8) of [rows, groups, size] values, rounded exactly as compressed-tensors does.

        Its arithmetic runs in the weight's dtype, where a bf16 op is the float32 op rounded to bf16;
        working in float32 and rounding to the weight's dtype after each op gives the same bits, and
        float32 reductions over short groups are several times faster than bf16 ones on a CPU.
        """
        dtype, wide = groups.dtype, groups.to(torch.float32, copy=True)
        scale = abs_max(wide, -1).to(dtype) / SCALE_DIVISOR
        scale = torch.where(scale == 0, torch.finfo(dtype).eps, scale)
        q = wide.div_(scale.unsqueeze(-1).float()).to(dtype)
        return scale, q.clamp_(QMIN, QMAX).round_().add_(8)  # + 8 is exact: the unsigned nibble

    def dequantize(self, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   shape: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Return the weight rebuilt as q * scale (in the scale dtype), cast to `dtype`. `shape` is the logical
        shape of what `tensors` hold (a shard's own); default: their `weight_shape` (a whole weight)."""
        packed, scale, _ = (tensors[n] for n in self.output_names(name))
        rows, cols = shape if shape is not None else self.logical_shape(name, tensors)
        q = unpack_int4(packed, cols).to(scale.dtype)
        return (q.view(rows, -1, self.group_size) * scale.unsqueeze(-1)).view(rows, cols).to(dtype)

    def output_units(self, name: str) -> dict[str, Optional[tuple[int, int]]]:
        """Return, per output of weight `name`, the weight elements one of its elements covers along each dim:
        a packed word 8 columns, a scale one group; `weight_shape` (the whole weight's) None: every shard
        holds it whole, as vLLM loads it."""
        packed, scale, logical = self.output_names(name)
        return {packed: (1, PACK), scale: (1, self.group_size), logical: None}
