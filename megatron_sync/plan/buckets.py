"""The sync plan: which bucket every HF tensor travels in, at which byte offset.

Computed once from metadata alone and identical on every rank (compare with
`SyncPlan.digest()`); executing a sync only walks it.

Rules:
- Buckets never mix pipeline stages; stage s's buckets all come before stage s+1's.
- Within a stage, tensors are grouped into buckets greedily in stream order:
  a bucket closes when the next tensor (or keep-together unit) would push it
  past `bucket_size_bytes`. A tensor larger than the bound gets a bucket of its own.
- Keep-together groups: tensors whose names fullmatch the patterns of one
  group *with the same captured values* (e.g. the same layer index) form one
  unit that lands in one bucket; the unit sits at its first member's position.
  Groups sharing a member merge (a DeepSeek q_a_proj weight, its FP8 scale and
  kv_a_proj_with_mqa's weight and scale form one unit).
- Alignment rule: inside a bucket, entries are laid out by dtype itemsize
  descending (stable in stream order) and packed back to back. Every tensor's
  nbytes is a multiple of its itemsize, so every offset is a multiple of its own
  itemsize with no padding at all: the bucket is exactly SGLang's / vLLM's
  flattened layout (cumulative offsets), and SGLang's "Unaligned received
  tensor" check passes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from megatron_sync.convert.patterns import Pattern, compile_pattern
from megatron_sync.core.bulk import without_gc
from megatron_sync.layout.rank import RankLayout
from megatron_sync.core.meta import FlatEntry, TensorMeta, dtype_name


KeepTogether = Sequence[Sequence[str]]
"""Groups of name patterns in the megatron_sync.convert' grammar (`{layer}`, `{expert}`, whole-name match); names
of one group with equal captured indices share a bucket. A model family declares its groups
(`megatron_sync.convert.Family.keep_together`); the default is none."""


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: its global index, the stage that sends it, its entries and size."""

    index: int
    stage: int
    entries: tuple[FlatEntry, ...]
    nbytes: int


@dataclass(frozen=True)
class SyncPlan:
    """Ordered buckets of all stages plus the bound they were cut with."""

    buckets: tuple[BucketPlan, ...]
    bucket_size_bytes: int
    num_stages: int

    def for_stage(self, stage: int) -> tuple[BucketPlan, ...]:
        """Return the buckets stage `stage` sends, in send order."""
        return tuple(b for b in self.buckets if b.stage == stage)

    def tensors(self) -> list[TensorMeta]:
        """Return every tensor the plan moves, in bucket order."""
        return [e.meta for b in self.buckets for e in b.entries]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    def digest(self) -> str:
        """Return the sha256 hex digest of a canonical JSON encoding of the plan."""
        canonical = {
            "bucket_size_bytes": self.bucket_size_bytes,
            "num_stages": self.num_stages,
            "buckets": [
                [b.index, b.stage, b.nbytes,
                 [[e.name, list(e.shape), dtype_name(e.dtype), e.offset, e.nbytes] for e in b.entries]]
                for b in self.buckets
            ],
        }
        encoded = json.dumps(canonical, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()


@without_gc
def build_plan(
    stage_metas: Sequence[Sequence[TensorMeta]],
    bucket_size_bytes: int,
    keep_together: KeepTogether = (),
) -> SyncPlan:
    """Return the SyncPlan for per-stage tensor lists given in stream order."""
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be > 0, got {bucket_size_bytes}")
    _check_unique_names(stage_metas)
    index = _KeepTogetherIndex(keep_together)  # once per plan, not per stage
    buckets: list[BucketPlan] = []
    for stage, metas in enumerate(stage_metas):
        for members in _cut_buckets(_units(metas, index), bucket_size_bytes):
            buckets.append(_layout(len(buckets), stage, members))
    return SyncPlan(tuple(buckets), bucket_size_bytes, len(stage_metas))


def _check_unique_names(stage_metas: Sequence[Sequence[TensorMeta]]) -> None:
    seen: dict[str, int] = {}
    for stage, metas in enumerate(stage_metas):
        for m in metas:
            if m.name in seen:
                raise ValueError(
                    f"tensor {m.name!r} is produced by stage {seen[m.name]} and stage {stage}; "
                    "each HF tensor must come from exactly one stage"
                )
            seen[m.name] = stage


def _units(metas: Iterable[TensorMeta], index: "_KeepTogetherIndex") -> list[list[TensorMeta]]:
    """Return stream-ordered units: single tensors, or keep-together components collected at their
    first member. Groups that share a member merge (keeping together is transitive)."""
    metas = list(metas)
    parent: dict[tuple, tuple] = {}

    def root(key: tuple) -> tuple:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of = [index.keys(m.name) for m in metas]
    for keys in keys_of:
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
    units: list[list[TensorMeta]] = []
    unit_of_root: dict[tuple, list[TensorMeta]] = {}
    for meta, keys in zip(metas, keys_of):
        if not keys:
            units.append([meta])
            continue
        component = root(keys[0])
        if component not in unit_of_root:
            unit_of_root[component] = []
            units.append(unit_of_root[component])
        unit_of_root[component].append(meta)
    return units


class _KeepTogetherIndex:
    """Which keep-together groups a name belongs to: literal patterns by dict, wildcard ones by scan."""

    def __init__(self, keep_together: KeepTogether) -> None:
        self._literal: dict[str, list[int]] = {}
        self._wildcard: list[tuple[int, Pattern]] = []
        for gi, group in enumerate(keep_together):
            for template in group:
                # A literal name (each quantized weight's values and scales: ~140k for Kimi-K2 in FP8) is a
                # dict key; compiling a regex per name made building the plan take a minute at that size.
                pattern = compile_pattern(template) if "{" in template else None
                if pattern is not None and pattern.fields:
                    self._wildcard.append((gi, pattern))
                else:
                    self._literal.setdefault(template, []).append(gi)

    def keys(self, name: str) -> list[tuple]:
        """Return one key per group `name` belongs to: (group, captured indices)."""
        keys = [(gi, ()) for gi in self._literal.get(name, ())]
        for gi, pattern in self._wildcard:
            captures = pattern.match(name)
            if captures is not None:
                keys.append((gi, tuple(sorted(captures.items()))))
        return keys


def _cut_buckets(units: list[list[TensorMeta]], bound: int) -> list[list[TensorMeta]]:
    """Return greedy bucket contents; a unit larger than `bound` is alone in its bucket."""
    cut: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for unit in units:
        unit_bytes = sum(m.nbytes for m in unit)
        if current and size + unit_bytes > bound:
            cut.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_bytes
    if current:
        cut.append(current)
    return cut


def _layout(index: int, stage: int, members: list[TensorMeta]) -> BucketPlan:
    """Return the bucket with entries ordered by itemsize descending, packed without gaps."""
    ordered = sorted(members, key=lambda m: -m.dtype.itemsize)  # sorted() is stable
    entries, offset = [], 0
    for m in ordered:
        assert offset % m.dtype.itemsize == 0, (m.name, offset)
        entries.append(FlatEntry(m.name, tuple(m.shape), m.dtype, offset, m.nbytes))
        offset += m.nbytes
    return BucketPlan(index, stage, tuple(entries), offset)


def layout_problem(layout: RankLayout, planned: Sequence[TensorMeta], *, who: str) -> Optional[str]:
    """Return why `layout` does not fit the `planned` tensors (see `RankLayout.check_against`), or None."""
    try:
        layout.check_against({m.name: m for m in planned}, who=who)
    except ValueError as e:
        return str(e)
    return None


def coverage_problem(planned: list[TensorMeta], expected: list[TensorMeta]) -> Optional[str]:
    """Return a message naming missing/unexpected/mismatched tensors, or None if they agree exactly."""
    have = {m.name: m for m in planned}
    want = {m.name: m for m in expected}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    mismatched = sorted(
        f"{n}: sent {tuple(have[n].shape)} {have[n].dtype}, engine expects {tuple(want[n].shape)} {want[n].dtype}"
        for n in set(have) & set(want)
        if (tuple(have[n].shape), have[n].dtype) != (tuple(want[n].shape), want[n].dtype)
    )
    parts = []
    if missing:
        parts.append(f"missing (engine expects, trainer does not send): {missing[:20]}")
    if unexpected:
        parts.append(f"unexpected (trainer sends, engine does not expect): {unexpected[:20]}")
    if mismatched:
        parts.append(f"mismatched: {mismatched[:20]}")
    return "; ".join(parts) or None
