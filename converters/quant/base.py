"""Helpers shared by the quantization formats: weight naming, shape checks, shard-edge checks."""

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


def check_boundary(name: str, dim: int, index: int, size: int, unit: int, setting: str) -> None:
    """Raise ValueError unless `index` (a shard edge along `dim`) is 0, `size`, or a multiple of `unit`."""
    if not 0 <= index <= size:
        raise ValueError(f"{name!r}: shard edge {index} is outside dim {dim} of size {size}")
    if index in (0, size) or index % unit == 0:
        return
    raise ValueError(
        f"{name!r}: a shard edge at index {index} of dim {dim} (size {size}) falls inside a "
        f"quantization unit of {unit} ({setting}); pick an inference tensor-parallel size whose shards "
        f"are multiples of {unit} along dim {dim}, or change {setting} in the HF quantization_config"
    )
