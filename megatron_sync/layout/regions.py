"""Regions of full tensors, and the one place a tensor-, expert- or vocabulary-parallel slice is computed.

A `Region` is a strided view of a full, contiguous HF tensor (offset, sizes and
strides in elements), so it can say anything an engine's loader does to a
checkpoint tensor: narrow a dim, pick an expert, split a fused tensor. A shard
role (`Shard`) says how engines split a tensor over their tensor-parallel
ranks; `role_range` turns a role into the rank's range of one dim, and
`rank_region` maps that range of a weight onto any tensor of the weight (the
weight itself, its FP8 block scales, its INT4 packed words and group scales),
which is how a weight and its scales are always cut alike.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_sync.core.meta import TensorMeta, dtype_from_name, dtype_name


class Shard(enum.Enum):
    """How inference engines split one HF tensor over their tensor-parallel ranks (its role).

    Each engine maps a role to its own slicing: the reference engine keeps VOCAB
    tensors whole on every rank, vLLM splits them in blocks of its padded vocabulary.
    """

    REPLICATED = "replicated"  # every rank holds the whole tensor (norms, routers, low-rank MLA downs)
    COLUMN = "column"  # dim 0 in contiguous equal chunks (q, MLA up-projections, gate/up)
    ROW = "row"  # dim 1 in contiguous equal chunks; partial outputs are summed (o_proj, down)
    KV_HEADS = "kv_heads"  # dim 0 by key/value heads, a head replicated on tp/kv ranks when tp > kv
    VOCAB = "vocab"  # dim 0 rows of the vocabulary (embeddings, lm_head)

    @property
    def dim(self) -> Optional[int]:
        """The tensor dimension this role splits (None when replicated)."""
        return {Shard.REPLICATED: None, Shard.ROW: 1}.get(self, 0)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Return the row-major strides (in elements) of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Region:
    """A strided view of a full, contiguous tensor: element `offset`, `sizes` and `strides`."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Region":
        """Return the region covering all of a tensor of `shape`."""
        return cls(0, tuple(shape), contiguous_strides(shape))

    @classmethod
    def box(cls, shape: Sequence[int], dim: int, start: int, length: int) -> "Region":
        """Return indices [start, start + length) of dim `dim` (all of every other dim) of a tensor of `shape`."""
        strides = contiguous_strides(shape)
        sizes = list(shape)
        sizes[dim] = length
        return cls(start * strides[dim], tuple(sizes), strides)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """Return this region of the contiguous tensor `full` (a view)."""
        assert full.is_contiguous(), "regions are views of contiguous full tensors"
        return full.as_strided(self.sizes, self.strides, full.storage_offset() + self.offset)

    def rows(self, start: int, count: int) -> "Region":
        """Return indices [start, start + count) of this region's first dim."""
        if not self.sizes:
            assert (start, count) == (0, 1), "a 0-d region has one row"
            return self
        return Region(self.offset + start * self.strides[0], (count, *self.sizes[1:]), self.strides)

    def is_contiguous(self) -> bool:
        """True when the region's elements lie back to back in row-major order."""
        want = contiguous_strides(self.sizes)
        return all(size <= 1 or got == expected for size, got, expected in zip(self.sizes, self.strides, want))

    def fits(self, shape: Sequence[int]) -> bool:
        """True when every element of the region lies inside a contiguous tensor of `shape`."""
        if any(s < 0 for s in self.sizes) or self.offset < 0 or any(st < 0 for st in self.strides):
            return False
        if self.numel == 0:
            return True
        last = self.offset + sum((size - 1) * stride for size, stride in zip(self.sizes, self.strides))
        return last < math.prod(shape)

    def to_wire(self) -> list:
        return [self.offset, list(self.sizes), list(self.strides)]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "Region":
        offset, sizes, strides = wire
        return cls(int(offset), tuple(sizes), tuple(strides))


@dataclass(frozen=True)
class TensorSpec(TensorMeta):
    """One full HF checkpoint tensor as the trainer produces it, with how engines shard it.

    `role` is the role of the weight it belongs to. For a quantized weight's part
    (its packed values, scales, shape), `weight_shape` is the weight's logical
    shape and `unit` the weight elements one element of this tensor covers along
    each dim (FP8 block scales: the block; INT4 packed words: 8 columns); `whole`
    marks a part every rank holds whole whatever the weight's role (a per-tensor
    scale, INT4's `weight_shape`).
    """

    role: Shard = Shard.REPLICATED
    weight_shape: Optional[tuple[int, ...]] = None
    unit: Optional[tuple[int, ...]] = None
    whole: bool = False
    expert: Optional[int] = None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape of the weight this tensor holds (its own shape for a plain tensor)."""
        return self.shape if self.weight_shape is None else self.weight_shape

    def to_wire(self) -> list:  # type: ignore[override]
        return [self.name, list(self.shape), dtype_name(self.dtype), self.role.value,
                None if self.weight_shape is None else list(self.weight_shape),
                None if self.unit is None else list(self.unit), self.whole, self.expert]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "TensorSpec":  # type: ignore[override]
        name, shape, dtype, role, weight_shape, unit, whole, expert = wire
        return cls(name, tuple(shape), dtype_from_name(dtype), Shard(role),
                   None if weight_shape is None else tuple(weight_shape), None if unit is None else tuple(unit),
                   bool(whole), expert)


# ---- ranges of one dim: every tensor-, expert- and vocabulary-parallel slice comes from here ----


def even_range(size: int, rank: int, parts: int, *, what: str = "tensor") -> tuple[int, int]:
    """Return (start, length) of chunk `rank` of `parts` equal contiguous chunks of `size` indices."""
    if parts < 1 or not 0 <= rank < parts:
        raise ValueError(f"{what}: rank {rank} is outside a tensor-parallel size of {parts}")
    if size % parts:
        raise ValueError(f"{what}: a dim of size {size} does not divide by the engine's tp_size={parts}; "
                         "pick a tp_size that divides it")
    step = size // parts
    return rank * step, step


def kv_head_range(size: int, num_kv_heads: int, rank: int, tp: int, *, what: str = "tensor") -> tuple[int, int]:
    """Return (start, length) of rank `rank`'s key/value heads among `size` = heads * head_dim rows.

    With more ranks than heads each head is replicated on tp / heads consecutive ranks
    (vLLM's and SGLang's GQA sharding).
    """
    if size % num_kv_heads:
        raise ValueError(f"{what}: dim 0 of size {size} is not num_key_value_heads={num_kv_heads} heads of "
                         "equal size; check num_key_value_heads and head_dim in the HF config")
    if num_kv_heads % tp == 0:
        return even_range(size, rank, tp, what=what)
    if tp % num_kv_heads:
        raise ValueError(f"{what}: num_key_value_heads={num_kv_heads} and tp_size={tp}: one must divide the other "
                         "(heads are split, or replicated when tp_size exceeds them)")
    head = size // num_kv_heads
    return rank // (tp // num_kv_heads) * head, head


def padded_vocab_range(vocab: int, rank: int, tp: int, padding: int) -> tuple[int, int, int]:
    """Return (start, length, rows per rank) of rank `rank`'s block of a vocabulary padded vLLM-style.

    The vocabulary is padded to a multiple of `padding`, every rank gets an equal block
    of the padded rows and loads the real rows of its block; the rest stays zero.
    """
    padded = math.ceil(vocab / padding) * padding
    if padded % tp:
        raise ValueError(f"padded vocabulary of {padded} rows does not divide by tp_size={tp}")
    per_rank = padded // tp
    start = min(rank * per_rank, vocab)
    return start, min(start + per_rank, vocab) - start, per_rank


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Return the global experts expert-parallel rank `ep_rank` holds ("linear" placement).

    Experts are split as evenly as possible; the first `num_experts % ep_size` ranks get one more.
    """
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} is outside ep_size={ep_size}")
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (1 if ep_rank < extra else 0))


VOCAB_WHOLE = "whole"  # every rank holds the whole vocabulary (the reference engine)
VOCAB_BLOCKS = "blocks"  # padded equal blocks per rank (vLLM, SGLang)


@dataclass(frozen=True)
class Sharding:
    """How one engine splits tensors over its tensor-parallel ranks: the settings every role needs."""

    tp_size: int
    num_kv_heads: int = 1
    vocab: str = VOCAB_WHOLE
    vocab_padding: int = 64

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.vocab not in (VOCAB_WHOLE, VOCAB_BLOCKS):
            raise ValueError(f"vocab must be {VOCAB_WHOLE!r} or {VOCAB_BLOCKS!r}, got {self.vocab!r}")

    def role_range(self, role: Shard, shape: Sequence[int], rank: int, *,
                   what: str = "tensor") -> Optional[tuple[int, int, int]]:
        """Return (dim, start, length) of rank `rank`'s part of a weight of `shape` with `role` (None: all)."""
        if self.tp_size == 1 or role is Shard.REPLICATED or (role is Shard.VOCAB and self.vocab == VOCAB_WHOLE):
            return None
        if role is Shard.VOCAB:
            start, length, _ = padded_vocab_range(shape[0], rank, self.tp_size, self.vocab_padding)
            return 0, start, length
        if role is Shard.KV_HEADS:
            return (0, *kv_head_range(shape[0], self.num_kv_heads, rank, self.tp_size, what=what))
        return (role.dim, *even_range(shape[role.dim], rank, self.tp_size, what=what))

    def rank_region(self, spec: TensorSpec, rank: int) -> Region:
        """Return the region of `spec` that rank `rank` holds: its weight's range, mapped onto `spec`."""
        cut = None if spec.whole else self.role_range(spec.role, spec.logical_shape, rank, what=spec.name)
        return Region.whole(spec.shape) if cut is None else weight_region(spec, *cut)


def weight_region(spec: TensorSpec, dim: int, start: int, length: int) -> Region:
    """Return the region of `spec` holding indices [start, start + length) of dim `dim` of its weight.

    A plain tensor is narrowed; a quantized weight's part is cut at the blocks or groups covering
    the range (`spec.unit`), and a part every rank holds (`spec.whole`) is returned whole. A shard
    edge inside a block or group raises ValueError naming the tensor.
    """
    if spec.whole:
        return Region.whole(spec.shape)
    unit = 1 if spec.unit is None else spec.unit[dim]
    size, stop = spec.logical_shape[dim], start + length
    for edge in (start, stop):
        if not 0 <= edge <= size:
            raise ValueError(f"{spec.name!r}: shard edge {edge} is outside dim {dim} of size {size}")
        if edge % unit and edge != size:
            raise ValueError(
                f"{spec.name!r}: a shard edge at index {edge} of dim {dim} (size {size}) falls inside a "
                f"quantization block or group of {unit}; pick an inference tensor-parallel size whose shards are "
                f"multiples of {unit} along dim {dim}, or change weight_block_size (FP8) or group_size (INT4) in the HF "
                f"quantization_config")
    first = start // unit
    return Region.box(spec.shape, dim, first, -(-stop // unit) - first)
