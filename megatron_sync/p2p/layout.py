"""Receiver layouts: which part of every HF tensor an inference rank needs, and where it keeps it.

A layout answers, from metadata alone, two questions for one rank of an engine:

1. which region of the full HF tensor the rank needs: rows [start, start + length) of one
   dim, or the whole tensor (`Region`), decided by the tensor's shard role (`Shard`) and the
   engine's rules for that role;
2. where that region lands: in which of the rank's stored tensors ("params") and at which
   byte offset. The reference engine stores every HF tensor under its own name; vLLM stacks
   q/k/v into `qkv_proj`, gate/up into `gate_up_proj` and routed experts into `w13_weight` /
   `w2_weight`, and pads its vocabulary shards.

A region is sent as its row-major contiguous bytes and lands in one contiguous byte range of
one param, so one shard is one range on the wire. A rank's params sit back to back (aligned)
in one flat staging buffer, which is what a one-sided transport registers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from converters.base import Shard
from megatron_sync.engines.reference import ENGINE_SPLIT
from megatron_sync.meta import TensorMeta, dtype_from_name, dtype_name


@dataclass(frozen=True)
class TensorSpec(TensorMeta):
    """One full HF tensor as the trainer produces it, and its shard role (from the family's row)."""

    role: Shard = Shard.REPLICATED


def tensor_specs(converter: Any) -> list[TensorSpec]:
    """Return every HF tensor of a converter's checkpoint with its family's shard role, in its order."""
    return [TensorSpec(m.name, m.shape, m.dtype, converter.shard_role(m.name)) for m in converter.expected_metas()]


def specs_to_wire(specs: Sequence[TensorSpec]) -> list[list]:
    """Return `specs` as JSON-able rows: [name, shape, dtype name, shard role]."""
    return [[s.name, list(s.shape), dtype_name(s.dtype), s.role.value] for s in specs]


def specs_from_wire(rows: Sequence[Sequence]) -> list[TensorSpec]:
    """Return the specs of `specs_to_wire` rows."""
    return [TensorSpec(name, tuple(shape), dtype_from_name(dtype), Shard(role)) for name, shape, dtype, role in rows]


@dataclass(frozen=True)
class Region:
    """Rows [start, start + length) of dim `dim` of a full tensor; `dim=None` is the whole tensor."""

    dim: int | None = None
    start: int = 0
    length: int = 0

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """Return this region of `full` (a view)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """Return the shape of this region of a tensor of `full_shape`."""
        shape = list(full_shape)
        if self.dim is not None:
            shape[self.dim] = self.length
        return tuple(shape)

    def nbytes(self, spec: TensorSpec) -> int:
        """Return the bytes of this region of `spec`."""
        return math.prod(self.shape(spec.shape)) * spec.dtype.itemsize


WHOLE = Region()


def even_region(spec: TensorSpec, dim: int, rank: int, parts: int) -> Region:
    """Return chunk `rank` of `parts` equal contiguous chunks of `spec` along `dim`."""
    size = spec.shape[dim]
    if size % parts:
        raise ValueError(
            f"{spec.name}: dim {dim} of size {size} does not divide by the engine's tp_size={parts}; "
            "pick a tp_size that divides it"
        )
    step = size // parts
    return Region(dim, rank * step, step)


def kv_head_region(spec: TensorSpec, num_kv_heads: int, rank: int, tp: int) -> Region:
    """Return rank `rank`'s key/value heads of `spec` (dim 0 = heads * head_dim).

    With more ranks than heads each head is replicated on tp / heads consecutive ranks
    (vLLM's and SGLang's GQA sharding).
    """
    if spec.shape[0] % num_kv_heads:
        raise ValueError(
            f"{spec.name}: dim 0 of size {spec.shape[0]} is not num_key_value_heads={num_kv_heads} "
            "heads of equal size; check num_key_value_heads and head_dim in the HF config"
        )
    if num_kv_heads % tp == 0:
        return even_region(spec, 0, rank, tp)
    if tp % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} and tp_size={tp}: one must divide the other"
        )
    head_dim = spec.shape[0] // num_kv_heads
    return Region(0, rank // (tp // num_kv_heads) * head_dim, head_dim)


def vllm_vocab_rows(vocab: int, rank: int, tp: int, padding: int) -> tuple[int, int, int]:
    """Return (start, length, rows per rank) of rank `rank`'s vocabulary shard, vLLM style.

    vLLM pads the vocabulary to a multiple of `padding`, gives every rank an equal block
    of the padded rows, and loads the real rows of its block; the rest stays zero.
    """
    per_rank = math.ceil(vocab / padding) * padding // tp
    if per_rank * tp != math.ceil(vocab / padding) * padding:
        raise ValueError(f"padded vocabulary of {vocab} rows does not divide by tp_size={tp}")
    start = min(rank * per_rank, vocab)
    return start, min(start + per_rank, vocab) - start, per_rank


@dataclass(frozen=True)
class Placement:
    """Where one HF tensor's region goes on a rank: param `param`, byte `offset` inside it."""

    name: str
    region: Region
    param: str
    offset: int
    nbytes: int


ParamSpec = TensorMeta  # one tensor a rank stores: an HF shard, or a stacked engine tensor

STAGING_ALIGNMENT = 64  # bytes; every param starts at a multiple (any dtype view is aligned)


@dataclass(frozen=True)
class RankLayout:
    """One inference rank's stored params and where each needed HF region lands in them."""

    params: tuple[ParamSpec, ...]
    placements: tuple[Placement, ...]

    def param_offsets(self) -> dict[str, int]:
        """Return each param's byte offset in the rank's flat staging buffer."""
        offsets, at = {}, 0
        for p in self.params:
            offsets[p.name] = at
            at += -(-p.nbytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT
        return offsets

    @property
    def nbytes(self) -> int:
        """Return the size of the flat staging buffer holding every param."""
        if not self.params:
            return 0
        last = self.params[-1]
        return self.param_offsets()[last.name] + last.nbytes

    @property
    def shard_bytes(self) -> int:
        """Return the bytes this rank receives (padding rows are never sent)."""
        return sum(p.nbytes for p in self.placements)

    def param_views(self, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return every param as a typed view into the flat uint8 `staging` buffer."""
        offsets = self.param_offsets()
        return {p.name: _typed(staging, offsets[p.name], p.nbytes, p.dtype, p.shape) for p in self.params}

    def shard_views(self, staging: torch.Tensor, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
        """Return each received HF region, by HF name, as a typed view into `staging`."""
        offsets = self.param_offsets()
        return {
            pl.name: _typed(staging, offsets[pl.param] + pl.offset, pl.nbytes, specs[pl.name].dtype,
                            pl.region.shape(specs[pl.name].shape))
            for pl in self.placements
        }


def _typed(staging: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return staging[offset:offset + nbytes].view(dtype).view(shape)


class EngineLayout(Protocol):
    """How one engine (a group of TP ranks) shards and stores the HF tensors."""

    kind: str
    tp_size: int

    def rank_layout(self, tensors: Sequence[TensorSpec], rank: int) -> RankLayout:
        """Return rank `rank`'s params and placements for the full tensors `tensors`."""

    def to_wire(self) -> dict[str, Any]:
        """Return the layout as JSON-able settings: {"kind": ..., and the constructor's arguments}."""


class ReferenceLayout:
    """The reference engine (`engines/reference.py`): one param per HF tensor, embeddings whole.

    COLUMN / ROW are even chunks of dim 0 / 1, KV_HEADS is `kv_head_region`, and REPLICATED
    and VOCAB are whole (every rank computes full-vocabulary logits without a gather).
    """

    kind = "reference"

    def __init__(self, tp_size: int, *, num_kv_heads: int):
        _check_tp(tp_size)
        self.tp_size, self.num_kv_heads = tp_size, num_kv_heads

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "tp_size": self.tp_size, "num_kv_heads": self.num_kv_heads}

    def region(self, spec: TensorSpec, rank: int) -> Region:
        """Return the region of `spec` that rank `rank` holds."""
        return WHOLE if self.tp_size == 1 else REFERENCE_REGIONS[spec.role](spec, rank, self)

    def rank_layout(self, tensors: Sequence[TensorSpec], rank: int) -> RankLayout:
        """Return rank `rank`'s layout: each HF tensor's region stored under its own name."""
        params, placements = [], []
        for spec in tensors:
            region = self.region(spec, rank)
            params.append(ParamSpec(spec.name, region.shape(spec.shape), spec.dtype))
            placements.append(Placement(spec.name, region, spec.name, 0, region.nbytes(spec)))
        return RankLayout(tuple(params), tuple(placements))


def _check_tp(tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")


class _Sizes(Protocol):
    tp_size: int
    num_kv_heads: int


def _whole(spec: TensorSpec, rank: int, engine: _Sizes) -> Region:
    return WHOLE


def _columns(spec: TensorSpec, rank: int, engine: _Sizes) -> Region:
    return even_region(spec, 0, rank, engine.tp_size)


def _rows(spec: TensorSpec, rank: int, engine: _Sizes) -> Region:
    return even_region(spec, 1, rank, engine.tp_size)


def _kv_heads(spec: TensorSpec, rank: int, engine: _Sizes) -> Region:
    return kv_head_region(spec, engine.num_kv_heads, rank, engine.tp_size)


def _vocab_block(spec: TensorSpec, rank: int, engine) -> Region:
    start, length, _ = vllm_vocab_rows(spec.shape[0], rank, engine.tp_size, engine.vocab_padding)
    return Region(0, start, length)


# How each engine slices each role: role -> (spec, rank, engine) -> Region.
_REGION_OF_SPLIT = {Shard.REPLICATED: _whole, Shard.COLUMN: _columns, Shard.ROW: _rows, Shard.KV_HEADS: _kv_heads}
REFERENCE_REGIONS = {role: _REGION_OF_SPLIT[split] for role, split in ENGINE_SPLIT.items()}  # the engine's table
VLLM_REGIONS = {**_REGION_OF_SPLIT, Shard.VOCAB: _vocab_block}


@dataclass(frozen=True)
class Stacked:
    """vLLM keeps the HF tensors matching `parts` stacked, in that order, on dim 0 of one param.

    `parts` are regexes that must match a whole name; their named groups fill `param`. A
    group called E is a routed expert's index: the param then has a leading expert dim and
    the experts are split over EP ranks when the engine runs expert parallel. Tensors are
    stacked only when every part of the param exists (MLA without q_lora_rank keeps its
    kv_a_proj_with_mqa on its own, as vLLM does).
    """

    param: str
    parts: tuple[str, ...]

    def match(self, name: str) -> tuple[int, dict[str, str]] | None:
        """Return (part index, captured groups) when `name` is one of the parts."""
        for index, part in enumerate(self.parts):
            m = re.fullmatch(part, name)
            if m:
                return index, m.groupdict()
        return None


_LAYER = r"model\.layers\.\d+"
_EXPERT = _LAYER + r"\.mlp\.experts"
VLLM_STACKED: tuple[Stacked, ...] = (
    Stacked("{p}.qkv_proj.{w}", tuple(rf"(?P<p>{_LAYER}\.self_attn)\.{x}_proj\.(?P<w>weight|bias)" for x in "qkv")),
    Stacked("{p}.gate_up_proj.weight",
            tuple(rf"(?P<p>{_LAYER}\.mlp(?:\.shared_experts)?)\.{x}_proj\.weight" for x in ("gate", "up"))),
    Stacked("{p}.fused_qkv_a_proj.weight",
            (rf"(?P<p>{_LAYER}\.self_attn)\.q_a_proj\.weight", rf"(?P<p>{_LAYER}\.self_attn)\.kv_a_proj_with_mqa\.weight")),
    Stacked("{p}.w13_weight", tuple(rf"(?P<p>{_EXPERT})\.(?P<E>\d+)\.{x}_proj\.weight" for x in ("gate", "up"))),
    Stacked("{p}.w2_weight", (rf"(?P<p>{_EXPERT})\.(?P<E>\d+)\.down_proj\.weight",)),
)


@dataclass(frozen=True)
class _Member:
    """One HF tensor's place in a vLLM param: which param, which expert slot, which part."""

    param: str
    expert: int | None
    part: int
    num_parts: int


class _Entry(NamedTuple):
    """One HF tensor's region on a rank and its slot (expert, part) inside its param."""

    slot: int | None
    part: int
    spec: TensorSpec
    region: Region


def linear_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Return the global experts EP rank `ep_rank` holds under vLLM's "linear" placement.

    Experts are split as evenly as possible; the first `num_experts % ep_size` ranks get one more.
    """
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (1 if ep_rank < extra else 0))


class VllmLayout:
    """vLLM's per-rank layout: vocab-parallel embeddings, stacked projections, experts by EP or TP.

    VOCAB rows are split in blocks of the padded vocabulary (`vllm_vocab_rows`); q/k/v,
    gate/up and MLA's q_a/kv_a projections are stacked per rank as `VLLM_STACKED` says; routed
    experts live in `w13_weight` [experts, 2 * intermediate, hidden] ([gate; up] per expert)
    and `w2_weight`. With `expert_parallel` every rank holds whole experts, split over the
    engine's ranks by `linear_expert_range`; without it every rank holds each expert's TP chunk.
    """

    kind = "vllm"

    def __init__(self, tp_size: int, *, num_kv_heads: int, expert_parallel: bool = False,
                 vocab_padding: int = 64, stacked: tuple[Stacked, ...] = VLLM_STACKED):
        _check_tp(tp_size)
        self.tp_size, self.num_kv_heads = tp_size, num_kv_heads
        self.expert_parallel, self.vocab_padding, self.stacked = expert_parallel, vocab_padding, stacked

    def to_wire(self) -> dict[str, Any]:
        if self.stacked is not VLLM_STACKED:
            raise ValueError("a VllmLayout with its own stacked table has no wire form; publish VLLM_STACKED layouts")
        return {"kind": self.kind, "tp_size": self.tp_size, "num_kv_heads": self.num_kv_heads,
                "expert_parallel": self.expert_parallel, "vocab_padding": self.vocab_padding}

    def rank_layout(self, tensors: Sequence[TensorSpec], rank: int) -> RankLayout:
        """Return rank `rank`'s params (vLLM's, per rank) and where each HF region lands in them."""
        members = self._members(tensors)
        num_experts = _experts_per_param(members.values())
        entries: dict[str, list[_Entry]] = {}
        for spec in tensors:
            member = members.get(spec.name)
            key = member.param if member else spec.name
            found = self._place(spec, member, rank, num_experts.get(key, 0))
            if found is not None:
                entries.setdefault(key, []).append(_Entry(found[0], member.part if member else 0, spec, found[1]))
        params, placements = [], []
        for key, items in entries.items():
            param, placed = self._stack(key, items, members.get(items[0].spec.name), rank)
            params.append(param)
            placements.extend(placed)
        order = {spec.name: i for i, spec in enumerate(tensors)}
        return RankLayout(tuple(params), tuple(sorted(placements, key=lambda p: order[p.name])))

    def _members(self, tensors: Sequence[TensorSpec]) -> dict[str, _Member]:
        """Return the stacked param of every tensor that vLLM stacks (all parts present)."""
        found: dict[str, _Member] = {}
        parts_seen: dict[tuple[str, int | None], set[int]] = {}
        for spec in tensors:
            for row in self.stacked:
                hit = row.match(spec.name)
                if hit is None:
                    continue
                part, groups = hit
                expert = int(groups.pop("E")) if "E" in groups else None
                member = found[spec.name] = _Member(row.param.format(**groups), expert, part, len(row.parts))
                parts_seen.setdefault((member.param, expert), set()).add(part)
                break
        complete = {(m.param, m.expert) for m in found.values()
                    if parts_seen[(m.param, m.expert)] == set(range(m.num_parts))}
        broken = sorted({m.param for m in found.values() if m.expert is not None and (m.param, m.expert) not in complete})
        if broken:
            raise ValueError(f"routed experts of {broken[:3]} lack some of their stacked projections")
        return {n: m for n, m in found.items() if (m.param, m.expert) in complete}

    def _place(self, spec: TensorSpec, member: _Member | None, rank: int,
               num_experts: int) -> tuple[int | None, Region] | None:
        """Return (expert slot, region) of `spec` on `rank`, or None when the rank does not hold it."""
        if member is not None and member.expert is not None and self.expert_parallel:
            owned = linear_expert_range(num_experts, rank, self.tp_size)
            return (member.expert - owned.start, WHOLE) if member.expert in owned else None
        return (member.expert if member else None), VLLM_REGIONS[spec.role](spec, rank, self)

    def _stack(self, key: str, items: list[_Entry], member: _Member | None,
               rank: int) -> tuple[ParamSpec, list[Placement]]:
        """Return the param `key` and its placements: parts back to back, per expert slot if any."""
        first = items[0]
        if member is None:  # stored on its own; VOCAB keeps its padded rows
            shape = first.region.shape(first.spec.shape)
            if first.spec.role is Shard.VOCAB:  # padded even at TP=1
                shape = (vllm_vocab_rows(first.spec.shape[0], rank, self.tp_size, self.vocab_padding)[2], *shape[1:])
            return ParamSpec(key, shape, first.spec.dtype), [
                Placement(first.spec.name, first.region, key, 0, first.region.nbytes(first.spec))]
        local = [e.region.shape(e.spec.shape) for e in items]
        if len({shape[1:] for shape in local}) != 1 or len({e.spec.dtype for e in items}) != 1:
            raise ValueError(f"{key}: stacked parts disagree in trailing shape or dtype: {local}")
        part_rows = {e.part: shape[0] for e, shape in zip(items, local)}
        row_bytes = math.prod(local[0][1:]) * first.spec.dtype.itemsize
        part_offset = {part: sum(part_rows[p] for p in range(part)) * row_bytes for part in part_rows}
        slot_bytes = sum(part_rows.values()) * row_bytes
        placements = [Placement(e.spec.name, e.region, key, (e.slot or 0) * slot_bytes + part_offset[e.part],
                                e.region.nbytes(e.spec)) for e in items]
        lead = () if member.expert is None else (len({e.slot for e in items}),)
        return ParamSpec(key, (*lead, sum(part_rows.values()), *local[0][1:]), first.spec.dtype), placements


def _experts_per_param(members) -> dict[str, int]:
    """Return the number of routed experts of every expert param."""
    experts: dict[str, set[int]] = {}
    for m in members:
        if m.expert is not None:
            experts.setdefault(m.param, set()).add(m.expert)
    return {param: len(found) for param, found in experts.items()}


ENGINE_LAYOUTS: dict[str, type] = {"reference": ReferenceLayout, "vllm": VllmLayout}
"""Engine layouts by the `kind` they publish (an inference rank sends its layout's `to_wire()`)."""


def engine_layout_from_wire(wire: dict[str, Any]) -> EngineLayout:
    """Return the engine layout `to_wire()` described; ValueError names an unknown kind or setting."""
    settings = dict(wire)
    kind = settings.pop("kind", None)
    if kind not in ENGINE_LAYOUTS:
        raise ValueError(f"engine layout kind {kind!r} is unknown; known kinds: {sorted(ENGINE_LAYOUTS)}")
    tp_size = settings.pop("tp_size")
    try:
        return ENGINE_LAYOUTS[kind](tp_size, **settings)
    except TypeError as e:
        raise ValueError(f"engine layout {wire}: {e}") from None
