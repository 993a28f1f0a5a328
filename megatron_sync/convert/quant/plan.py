"""`QuantPlan`: which HF weights are quantized and how, the one object megatron_sync.convert and engines consult.

Built once from the HF `quantization_config` and the checkpoint's names; it
turns a converted (name, tensor) into the engine's quantized tensors, rewrites
the expected checkpoint layout for the completeness check, maps a received
scale back to its weight, and slices a weight and its scales for a TP rank.
Unquantized names pass through every method unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from megatron_sync.convert.quant.config import (
    DEFAULT_UNQUANTIZED, IsLinearWeight, QuantScheme, parse_quantization_config, select_targets,
)
from megatron_sync.convert.quant.fp8 import Fp8Block, Fp8Tensor
from megatron_sync.convert.quant.int4 import Int4Group
from megatron_sync.layout.regions import Shard, TensorSpec, weight_region
from megatron_sync.core.meta import TensorMeta

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def quantized_names(name: str, shape: Iterable[int], dtype: torch.dtype, scheme: QuantScheme
                    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Return (name, shape, dtype) of each tensor `quantize` makes from weight `name`, without data."""
    return [(m.name, m.shape, m.dtype) for m in scheme.outputs(name, tuple(shape), dtype)]


def quantize(name: str, tensor: torch.Tensor, scheme: QuantScheme) -> list[tuple[str, torch.Tensor]]:
    """Return the engine-format (name, tensor) pairs of the full weight `tensor` under `scheme`."""
    return scheme.quantize(name, tensor)


def dequantize(name: str, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme,
               dtype: torch.dtype = torch.float32, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """Return weight `name` rebuilt from its quantized tensors (keyed by their names), cast to `dtype`;
    `shape` is the logical shape they hold (a shard's own; default: the whole weight's)."""
    return scheme.dequantize(name, tensors, dtype, shape)


def _part_specs(name: str, outputs: Iterable[TensorMeta], weight_shape: tuple[int, ...], scheme: QuantScheme,
                role: Shard) -> list[TensorSpec]:
    units = scheme.output_units(name)
    return [TensorSpec(m.name, m.shape, m.dtype, role, weight_shape, units[m.name], units[m.name] is None)
            for m in outputs]


def part_specs(name: str, shape: Iterable[int], dtype: torch.dtype, scheme: QuantScheme,
               role: Shard = Shard.REPLICATED) -> list[TensorSpec]:
    """Return the specs of the tensors `quantize` makes from weight `name` (of `shape`, `role`): each with the
    weight's shape and how a slice of the weight maps onto it (`TensorSpec.unit` / `whole`)."""
    shape = tuple(shape)
    return _part_specs(name, scheme.outputs(name, shape, dtype), shape, scheme, role)


def slice_quantized(name: str, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, dim: int,
                    start: int, stop: int) -> dict[str, torch.Tensor]:
    """Return the quantized tensors of the whole weight `name` that hold its rows (dim 0) or cols (dim 1)
    [start, stop), scales included (`weight_region`; a per-tensor scale and `weight_shape` whole).

    Raises ValueError when an edge falls inside a scale block or group.
    """
    if dim not in (0, 1) or not 0 <= start < stop:
        raise ValueError(f"{name!r}: cannot slice dim {dim} over [{start}, {stop})")
    outputs = [TensorMeta.of(out, tensors[out]) for out in scheme.output_names(name)]
    specs = _part_specs(name, outputs, tuple(scheme.logical_shape(name, tensors)), scheme, Shard.REPLICATED)
    return {spec.name: weight_region(spec, dim, start, stop - start).of(tensors[spec.name].contiguous())
            for spec in specs}


def shard_quantized(name: str, tensors: Mapping[str, torch.Tensor], scheme: QuantScheme, dim: int,
                    rank: int, world: int) -> dict[str, torch.Tensor]:
    """Return rank `rank`'s equal contiguous chunk of `world` along `dim`, with its scales."""
    size = scheme.logical_shape(name, tensors)[dim]
    if not 0 <= rank < world or size % world:
        raise ValueError(f"{name!r}: dim {dim} of size {size} does not split into {world} equal shards "
                         f"(rank {rank}); choose a tensor-parallel size that divides {size}")
    chunk = size // world
    return slice_quantized(name, tensors, scheme, dim, rank * chunk, (rank + 1) * chunk)


# The output names of every format, for a weight "w.weight": how a received name is recognized as a
# quantized weight's part without the plan (an engine knows the names it expects, not the trainer's config).
_SUFFIXES = tuple(dict.fromkeys(
    out.removeprefix("w.")
    for scheme in (Fp8Block(), Fp8Tensor(), Int4Group()) for out in scheme.output_names("w.weight")
))


def output_weight(name: str) -> str | None:
    """Return the weight name ("x.weight") whose quantized part `name` is by its name alone ("x.weight_scale"
    -> "x.weight"), or None when `name` is no format's scale, packed values or shape."""
    for suffix in _SUFFIXES:
        if suffix != "weight" and name.endswith("." + suffix):
            return name[: -len(suffix)] + "weight"
    return None


def output_groups(names: Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """Return, in name order, one group per quantized weight among `names`: its outputs (values, scales,
    shape) that must share a bucket. A weight that appears alone (unquantized) forms no group."""
    by_prefix: dict[str, list[str]] = {}
    for name in names:
        for suffix in _SUFFIXES:
            if name.endswith("." + suffix):
                by_prefix.setdefault(name[: -len(suffix)], []).append(name)
                break
    return tuple(tuple(sorted(group)) for _, group in sorted(by_prefix.items())
                 if len(group) > 1 or not group[0].endswith(".weight"))


class QuantPlan:
    """The quantized HF weights of one model: {weight name: scheme}, with the operations on them."""

    def __init__(self, schemes: Mapping[str, QuantScheme]):
        self.schemes: dict[str, QuantScheme] = dict(schemes)
        self._weight_of = {out: name for name, s in self.schemes.items() for out in s.output_names(name)}

    @classmethod
    def from_hf_config(cls, quantization_config: Any, hf_names: Iterable[str], is_linear_weight: IsLinearWeight,
                       *, keep_unquantized: Iterable[str] = DEFAULT_UNQUANTIZED) -> "QuantPlan":
        """Return the plan for an HF `quantization_config` over the checkpoint names `hf_names`."""
        config = parse_quantization_config(quantization_config)
        return cls(select_targets(config, hf_names, is_linear_weight, keep_unquantized=keep_unquantized))

    def scheme_of(self, name: str) -> QuantScheme | None:
        """Return the scheme quantizing HF weight `name`, or None if it travels unquantized."""
        return self.schemes.get(name)

    def weight_of(self, produced_name: str) -> str | None:
        """Return the HF weight a produced tensor (a scale, a packed weight) belongs to, or None."""
        return self._weight_of.get(produced_name)

    def quantize(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Return the engine-format (name, tensor) pairs for converted HF tensor `name`."""
        scheme = self.schemes.get(name)
        return [(name, tensor)] if scheme is None else scheme.quantize(name, tensor)

    def outputs(self, name: str, shape: Iterable[int], dtype: torch.dtype) -> list[TensorMeta]:
        """Return the metadata `quantize` produces for HF tensor `name` of this shape and dtype."""
        scheme = self.schemes.get(name)
        shape = tuple(shape)
        return [TensorMeta(name, shape, dtype)] if scheme is None else scheme.outputs(name, shape, dtype)

    def expected_layout(self, layout: Layout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Return the converter's expected {name: (shape, dtype)}, each quantized weight replaced by its outputs."""
        missing = sorted(set(self.schemes) - set(layout))
        if missing:
            raise ValueError(f"quantized weights {missing[:8]} are not in the expected HF layout; "
                             f"build the QuantPlan from the same names the converter expects")
        return {m.name: (m.shape, m.dtype) for name, (shape, dtype) in layout.items()
                for m in self.outputs(name, shape, dtype)}

    def keep_together(self) -> tuple[tuple[str, ...], ...]:
        """Return one group per quantized weight: the weight's output names and its scales', which
        must share a bucket (literal names in the megatron_sync.convert' pattern grammar)."""
        return output_groups(out for name, s in self.schemes.items() for out in s.output_names(name))

    def specs(self, name: str, shape: Iterable[int], dtype: torch.dtype, role: Shard) -> list[TensorSpec]:
        """Return the specs of what `quantize` produces for HF tensor `name` (itself when unquantized)."""
        scheme = self.schemes.get(name)
        if scheme is None:
            return [TensorSpec(name, tuple(shape), dtype, role)]
        return part_specs(name, shape, dtype, scheme, role)

    def dequantize(self, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """Return HF weight `name` in `dtype`, rebuilt from its quantized tensors when it is quantized;
        `shape` is the logical shape they hold (a shard's own; default: the whole weight's)."""
        scheme = self.schemes.get(name)
        return tensors[name].to(dtype) if scheme is None else scheme.dequantize(name, tensors, dtype, shape)

