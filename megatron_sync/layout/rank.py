"""One inference rank's layout: the params it stores, and where each needed HF region lands in them.

A `Placement` puts one `Region` of one full HF tensor, as its row-major
contiguous bytes, at a byte offset of one param; a rank's params sit back to
back (aligned) in one flat staging buffer, so every placement is one byte range
of that buffer: what a one-sided transport writes into and what a receiver that
holds full tensors copies into. The reference engine stores each HF tensor's
shard as its own param; vLLM stacks q/k/v, gate/up and experts into fused
params (its layout is recorded from its own weight loaders).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from megatron_sync.layout.regions import Region, TensorSpec
from megatron_sync.core.meta import TensorMeta, dtype_from_name, dtype_name

ParamSpec = TensorMeta  # one tensor a rank stores: an HF shard, or an engine's fused param
STAGING_ALIGNMENT = 64  # bytes; every param starts at a multiple (any dtype view is aligned)


@dataclass(frozen=True)
class Placement:
    """Region `source` of full HF tensor `name`, row-major, lands at byte `offset` of param `param`."""

    name: str
    source: Region
    param: str
    offset: int
    nbytes: int

    def to_wire(self) -> list:
        return [self.name, self.source.to_wire(), self.param, self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "Placement":
        name, source, param, offset, nbytes = wire
        return cls(name, Region.from_wire(source), param, int(offset), int(nbytes))


def placements_of_copy(name: str, source: Region, param: ParamSpec, dest: Region) -> list[Placement]:
    """Return the placements that copy region `source` of HF tensor `name` into region `dest` of `param`.

    A destination that is not one contiguous run (a loader writing a column block) becomes one
    placement per contiguous run, each with the matching part of the source.
    """
    if source.sizes != dest.sizes:
        raise ValueError(f"{name} -> {param.name}: a copy of {source.sizes} elements into {dest.sizes}")
    itemsize = param.dtype.itemsize
    for first in range(len(dest.sizes) + 1):  # dims first.. are contiguous in the param
        inner = Region(dest.offset, dest.sizes[first:], dest.strides[first:])
        if inner.is_contiguous():
            break
    placements = []
    for index in itertools.product(*(range(n) for n in dest.sizes[:first])):
        d = dest.offset + sum(i * s for i, s in zip(index, dest.strides))
        s = source.offset + sum(i * st for i, st in zip(index, source.strides))
        part = Region(s, source.sizes[first:], source.strides[first:])
        placements.append(Placement(name, part, param.name, d * itemsize, part.numel * itemsize))
    return placements


@dataclass(frozen=True)
class RankLayout:
    """One inference rank's stored params and where each needed HF region lands in them."""

    params: tuple[ParamSpec, ...]
    placements: tuple[Placement, ...]

    @functools.cached_property
    def param_offsets(self) -> dict[str, int]:
        """Each param's byte offset in the rank's flat staging buffer."""
        offsets, at = {}, 0
        for p in self.params:
            offsets[p.name] = at
            at += -(-p.nbytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT
        return offsets

    @functools.cached_property
    def nbytes(self) -> int:
        """The size of the flat staging buffer holding every param (a multiple of the alignment)."""
        if not self.params:
            return 0
        last = self.params[-1]
        return -(-(self.param_offsets[last.name] + last.nbytes) // STAGING_ALIGNMENT) * STAGING_ALIGNMENT

    @property
    def shard_bytes(self) -> int:
        """The bytes this rank receives: every placement once (padding rows are never sent)."""
        return sum(p.nbytes for p in self.placements)

    @functools.cached_property
    def _params(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    @functools.cached_property
    def by_name(self) -> dict[str, tuple[Placement, ...]]:
        """Placements grouped by HF tensor name, in layout order."""
        grouped: dict[str, list[Placement]] = {}
        for p in self.placements:
            grouped.setdefault(p.name, []).append(p)
        return {name: tuple(ps) for name, ps in grouped.items()}

    def staging_offset(self, placement: Placement) -> int:
        """Return the byte offset of `placement` in the flat staging buffer."""
        return self.param_offsets[placement.param] + placement.offset

    def param_views(self, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return every param as a typed view into the flat uint8 `staging` buffer."""
        return {p.name: _typed(staging, self.param_offsets[p.name], p.nbytes, p.dtype, p.shape) for p in self.params}

    def destination(self, staging: torch.Tensor, placement: Placement) -> torch.Tensor:
        """Return where `placement` lands in `staging`, typed and shaped like its source region."""
        dtype = self._params[placement.param].dtype
        return _typed(staging, self.staging_offset(placement), placement.nbytes, dtype, placement.source.sizes)

    def write(self, staging: torch.Tensor, name: str, full: torch.Tensor) -> int:
        """Copy every region this rank needs of full HF tensor `name` into `staging`; return bytes copied."""
        copied = 0
        for placement in self.by_name.get(name, ()):
            self.destination(staging, placement).copy_(placement.source.of(full))
            copied += placement.nbytes
        return copied

    def params_from(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return every param built from full HF `tensors`: a view where one region is the whole param,
        else a new tensor the regions are copied into."""
        covering = {}
        for placement in self.placements:
            covering.setdefault(placement.param, []).append(placement)
        params = {}
        for param in self.params:
            parts = covering.get(param.name, [])
            if len(parts) == 1 and parts[0].offset == 0 and parts[0].nbytes == param.nbytes:
                view = parts[0].source.of(tensors[parts[0].name])
                params[param.name] = view.reshape(param.shape) if view.is_contiguous() else view.view(param.shape)
                continue
            flat = torch.zeros(param.nbytes, dtype=torch.uint8)
            for p in parts:
                flat[p.offset:p.offset + p.nbytes].view(param.dtype).view(p.source.sizes).copy_(p.source.of(tensors[p.name]))
            params[param.name] = flat.view(param.dtype).view(param.shape)
        return params

    def check_against(self, specs: Mapping[str, TensorMeta], *, who: str) -> None:
        """Raise ValueError naming every placement that does not fit the trainer's HF tensors `specs`:
        an unknown name, a dtype that differs from its param's, a region outside the tensor, or a
        destination outside its param."""
        problems = []
        for p in self.placements:
            spec, param = specs.get(p.name), self._params.get(p.param)
            if spec is None:
                problems.append(f"{p.name} (into {p.param}): the trainer does not produce it")
            elif param is None:
                problems.append(f"{p.name}: lands in {p.param!r}, which is not a param of this layout")
            elif spec.dtype != param.dtype:
                problems.append(f"{p.name}: the trainer sends {dtype_name(spec.dtype)}, {p.param} holds "
                                f"{dtype_name(param.dtype)}")
            elif not p.source.fits(spec.shape):
                problems.append(f"{p.name}: this rank reads {p.source.sizes} at offset {p.source.offset} "
                                f"(strides {p.source.strides}), outside the trainer's shape {tuple(spec.shape)}")
            elif p.offset + p.nbytes > param.nbytes or p.nbytes != p.source.numel * param.dtype.itemsize:
                problems.append(f"{p.name}: {p.nbytes} bytes at {p.offset} do not fit {p.param} "
                                f"({tuple(param.shape)} {dtype_name(param.dtype)})")
        if problems:
            more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise ValueError(f"{who}: {len(problems)} tensor(s) do not fit what the trainer sends: "
                             f"{'; '.join(problems[:8])}{more}; the trainer's HF config and family must be "
                             "the served model's")

    def to_wire(self) -> dict:
        return {"params": [list(p.to_wire()) for p in self.params],
                "placements": [p.to_wire() for p in self.placements]}

    @classmethod
    def from_wire(cls, wire: Mapping) -> "RankLayout":
        return cls(tuple(ParamSpec(n, tuple(s), dtype_from_name(d)) for n, s, d in wire["params"]),
                   tuple(Placement.from_wire(p) for p in wire["placements"]))

    def digest(self) -> str:
        """Return the sha256 of the canonical wire form."""
        return hashlib.sha256(json.dumps(self.to_wire(), separators=(",", ":")).encode()).hexdigest()


def _typed(staging: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return staging[offset:offset + nbytes].view(dtype).view(tuple(shape))


def specs_to_wire(specs: Sequence[TensorSpec]) -> list[list]:
    """Return `specs` as JSON-able rows."""
    return [s.to_wire() for s in specs]


def specs_from_wire(rows: Sequence[Sequence]) -> list[TensorSpec]:
    """Return the specs of `specs_to_wire` rows."""
    return [TensorSpec.from_wire(row) for row in rows]


def one_param_per_tensor(specs: Sequence[TensorSpec], region_of) -> RankLayout:
    """Return the layout storing each HF tensor's region (`region_of(spec)`, None: not held) as its own param."""
    params, placements = [], []
    for spec in specs:
        region: Optional[Region] = region_of(spec)
        if region is None:
            continue
        params.append(ParamSpec(spec.name, region.sizes, spec.dtype))
        placements.append(Placement(spec.name, region, spec.name, 0, region.numel * spec.dtype.itemsize))
    return RankLayout(tuple(params), tuple(placements))
