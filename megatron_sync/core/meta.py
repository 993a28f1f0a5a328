"""Tensor metadata shared by megatron_sync.convert, the plan, buckets and transports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES_BY_NAME = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "uint8", "int16", "int32", "int64", "bool",
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the torch attribute name of `dtype` ("bfloat16"), as engines spell it on the wire."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype called `name`; raise ValueError naming the supported set."""
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {sorted(_DTYPES_BY_NAME)}"
        ) from None


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor, known without touching its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_wire(self) -> tuple[str, tuple[int, ...], str]:
        """Return a plain, picklable and hashable form: (name, shape, dtype name)."""
        return (self.name, tuple(self.shape), dtype_name(self.dtype))

    @classmethod
    def from_wire(cls, wire: tuple[str, tuple[int, ...], str]) -> "TensorMeta":
        name, shape, dtype = wire
        return cls(name, tuple(shape), dtype_from_name(dtype))

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class FlatEntry:
    """Where one tensor's raw bytes sit in a flat byte buffer (a bucket, a disk-delta version): the one entry
    type of every packed buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.name, self.shape, self.dtype)
