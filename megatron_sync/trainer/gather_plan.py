"""What a gather moves, planned on metadata alone: the `GatherUnit`s of a stage (one full Megatron tensor each,
with where its shards live), their batches under a memory budget, and the strided merge and split of TP
shards (`megatron_sync.trainer.gather.ShardGatherer` runs the collectives)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.source import Split, SourceTensor


def _piece_sizes(stride: int | tuple[int, ...], length: int, size: int) -> list[int]:
    """Return the sizes of the pieces one shard of `length` holds along its dim (see `Split.stride`)."""
    if isinstance(stride, int):
        return [length // stride] * stride
    return [piece // size for piece in stride]


def merge_strided_shards(shards: list[torch.Tensor], dim: int, stride: int | tuple[int, ...]) -> torch.Tensor:
    """Return the full tensor from equal TP shards along `dim`.

    With stride s each shard holds s consecutive pieces (gated linear_fc1:
    `[gate_r; up_r]`), and the full tensor is piece 0 of every shard, then
    piece 1 of every shard, and so on. A tuple stride gives unequal pieces by
    their sizes in the full tensor (each shard holds 1/len(shards) of each).
    """
    if stride == 1:
        return torch.cat(shards, dim=dim)
    sizes = _piece_sizes(stride, shards[0].shape[dim], len(shards))
    pieces = [shard.split(sizes, dim=dim) for shard in shards]
    return torch.cat([p[k] for k in range(len(sizes)) for p in pieces], dim=dim)


def split_strided_shard(full: torch.Tensor, dim: int, stride: int | tuple[int, ...], size: int,
                        rank: int) -> torch.Tensor:
    """Return rank `rank`'s shard of `full` (the inverse of `merge_strided_shards`)."""
    sizes = _piece_sizes(stride, full.shape[dim] // size, size)
    full_pieces = full.split([piece * size for piece in sizes], dim=dim)
    return torch.cat([piece.chunk(size, dim=dim)[rank] for piece in full_pieces], dim=dim)


@dataclass(frozen=True)
class GatherUnit:
    """One full Megatron tensor to produce: its global name, full shape and where its shards live.

    `local` is this rank's shard, or None for a routed expert another EP rank owns. `dtype` is the
    dtype it is gathered in: the parameter's, or a narrower one the converter allows (see
    `Converter.gather_dtype`); a tensor that needs no gather is yielded as the local parameter itself.
    """

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: Split
    local: torch.Tensor | None
    device: torch.device
    owner_ep: int | None = None  # routed experts only

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.full_shape:
            n *= s
        return n


def _full_shape(t: SourceTensor, layout: ParallelLayout) -> tuple[int, ...]:
    shape = list(t.tensor.shape)
    size = {"tp": layout.tp, "etp": layout.etp}.get(t.sharding.axis, 1)
    if t.sharding.axis is not None:
        shape[t.sharding.dim] *= size
    return tuple(shape)


def plan_gather_units(tensors: list[SourceTensor], layout: ParallelLayout) -> list[GatherUnit]:
    """Return the units of one stage in a deterministic order, identical on all its ranks.

    Dense tensors keep model order. A layer's routed experts are listed at the
    place of its first expert parameter, by global expert index, then by kind
    (linear_fc1 before linear_fc2), so every EP rank lists every expert.
    """
    units: list[GatherUnit] = []
    templates: dict[int, list[str]] = {}
    local_experts: dict[tuple[str, int], SourceTensor] = {}
    num_local_by_layer: dict[int, int] = {}
    emitted: set[int] = set()
    for t in tensors:
        if t.expert is not None:
            layer_templates = templates.setdefault(t.expert.layer, [])
            if t.expert.template not in layer_templates:
                layer_templates.append(t.expert.template)
            local_experts[(t.expert.template, t.expert.local_index)] = t
            num_local_by_layer[t.expert.layer] = t.expert.num_local
    for t in tensors:
        if t.expert is None:
            units.append(
                GatherUnit(t.name, _full_shape(t, layout), t.tensor.dtype, t.sharding, t.tensor, t.tensor.device)
            )
            continue
        layer = t.expert.layer
        if layer in emitted:
            continue
        emitted.add(layer)
        num_local = num_local_by_layer[layer]
        for expert in range(num_local * layout.ep):
            owner, j = divmod(expert, num_local)
            for template in templates[layer]:
                ref = local_experts[(template, 0)]
                mine = local_experts[(template, j)].tensor if owner == layout.ep_rank else None
                units.append(
                    GatherUnit(
                        template.format(expert=expert), _full_shape(ref, layout), ref.tensor.dtype,
                        ref.sharding, mine, ref.tensor.device, owner_ep=owner,
                    )
                )
    return units


def _batch_key(unit: GatherUnit, etp: int) -> tuple | None:
    """Return what units must share to travel in one collective (None: alone).

    TP-sharded dense tensors share one gather over the TP group; routed experts
    of one owning EP rank, whole on it (no ETP split), share one point-to-point
    message to EP rank 0.
    """
    if unit.owner_ep is None:
        return ("tp",) if unit.sharding.axis == "tp" else None
    if unit.sharding.axis != "etp" or etp == 1:
        return ("ep", unit.owner_ep)
    return None


def _batches(units: list[GatherUnit], budget_bytes: int, etp: int = 1, tp: int = 1) -> Iterator[list[GatherUnit]]:
    """Group consecutive units of one batch key up to their bound; everything else alone.

    A TP batch holds its full tensors plus this rank's flat contribution (1/tp of them) during
    the gather, so its full bytes stay within budget * tp / (tp + 1).
    """
    batch: list[GatherUnit] = []
    batch_bytes = 0
    key = None
    for unit in units:
        unit_key = _batch_key(unit, etp)
        bound = budget_bytes * tp // (tp + 1) if unit_key == ("tp",) else budget_bytes
        if batch and (unit_key != key or batch_bytes + unit.nbytes > bound):
            yield batch
            batch, batch_bytes = [], 0
        if unit_key is None:
            yield [unit]
            continue
        batch.append(unit)
        batch_bytes += unit.nbytes
        key = unit_key
    if batch:
        yield batch
