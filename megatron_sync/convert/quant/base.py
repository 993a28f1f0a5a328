"""Helpers shared by the quantization formats: weight naming, shape checks, row chunks."""

from __future__ import annotations

import torch


def weight_prefix(name: str) -> str:
    """Return `name` without its trailing `weight` ("a.b.weight" -> "a.b."); raise if it is not a weight."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name!r} is not a weight name (ends in '.weight'); only weights are quantized")
    return name[: -len("weight")]


def require_2d(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """Return (rows, cols) of a 2-D shape; raise ValueError naming the tensor otherwise."""
    if len(shape) != 2:
        raise ValueError(f"{name!r} has shape {tuple(shape)}; quantization applies to 2-D linear weights only")
    return int(shape[0]), int(shape[1])


def require_float(name: str, dtype: torch.dtype) -> None:
    """Raise ValueError unless `dtype` is a source dtype the quantizers accept (fp32, bf16, fp16)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name!r} has dtype {dtype}; quantize from float32, bfloat16 or float16")


# Quantization runs over row chunks of about this many elements: it bounds the float32 temporaries
# to 16 MiB whatever the weight's size, and keeps them in cache on a CPU.
CHUNK_ELEMS = 1 << 22


def row_chunks(rows: int, cols: int, unit: int) -> list[tuple[int, int]]:
    """Return [start, stop) row ranges of about CHUNK_ELEMS elements each, every start a multiple of `unit`."""
    step = max(1, CHUNK_ELEMS // max(1, unit * cols)) * unit
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def abs_max(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """Return max |x| over `dim` in x's dtype, exactly, without materializing |x| (two reductions)."""
    if dim is None:
        return torch.maximum(x.amax(), x.amin().neg())
    return torch.maximum(x.amax(dim=dim, keepdim=keepdim), x.amin(dim=dim, keepdim=keepdim).neg_())
