"""Layouts computed from each tensor's shard role, and the wire form every inference rank publishes.

`RoleLayout` is the layout of an engine that stores each HF tensor's shard as
its own param and slices by role (`Sharding`): the reference engine, and the
vLLM-style shape (vocabulary in padded blocks, experts by expert parallelism)
the planners use where no live engine recorded its layout. An engine that
records its layout from its own loaders (vLLM) publishes it explicitly.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from megatron_sync.layout.rank import RankLayout, one_param_per_tensor
from megatron_sync.layout.regions import Region, Sharding, TensorSpec, expert_range


class RoleLayout:
    """An engine of `sharding.tp_size` ranks slicing every tensor by its role; with `expert_parallel`,
    routed experts are not sliced but spread whole over the ranks (`expert_range`)."""

    kind = "roles"

    def __init__(self, sharding: Sharding, *, expert_parallel: bool = False):
        self.sharding, self.expert_parallel = sharding, expert_parallel

    @property
    def tp_size(self) -> int:
        return self.sharding.tp_size

    def region(self, spec: TensorSpec, rank: int, num_experts: int = 0) -> Optional[Region]:
        """Return the region of `spec` rank `rank` holds (None: another rank's expert)."""
        if self.expert_parallel and spec.expert is not None:
            held = expert_range(num_experts, rank, self.tp_size)
            return Region.whole(spec.shape) if spec.expert in held else None
        return self.sharding.rank_region(spec, rank)

    def rank_layout(self, specs: Sequence[TensorSpec], rank: int) -> RankLayout:
        """Return rank `rank`'s layout: each HF tensor's region stored under its own name."""
        num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
        return one_param_per_tensor(specs, lambda spec: self.region(spec, rank, num_experts))

    def to_wire(self, rank: int) -> dict[str, Any]:
        """Return rank `rank`'s layout in compact form (every peer expands it from the specs)."""
        s = self.sharding
        return {"kind": self.kind, "rank": rank, "tp_size": s.tp_size, "num_kv_heads": s.num_kv_heads,
                "vocab": s.vocab, "vocab_padding": s.vocab_padding, "expert_parallel": self.expert_parallel}


def explicit_wire(layout: RankLayout) -> dict[str, Any]:
    """Return a rank layout as published in full (a recorded layout)."""
    return {"kind": "explicit", **layout.to_wire()}


def rank_layout_from_wire(wire: Mapping[str, Any], specs: Sequence[TensorSpec]) -> RankLayout:
    """Return the rank layout a rank published (`RoleLayout.to_wire` or `explicit_wire`), over `specs`."""
    settings = dict(wire)
    kind = settings.pop("kind", None)
    if kind == "explicit":
        return RankLayout.from_wire(settings)
    if kind == RoleLayout.kind:
        rank, expert_parallel = settings.pop("rank"), settings.pop("expert_parallel")
        try:
            sharding = Sharding(**settings)
        except TypeError as e:
            raise ValueError(f"engine layout {dict(wire)}: {e}") from None
        return RoleLayout(sharding, expert_parallel=expert_parallel).rank_layout(specs, rank)
    raise ValueError(f"engine layout kind {kind!r} is unknown; known kinds: ['explicit', {RoleLayout.kind!r}]")
