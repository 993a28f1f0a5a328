"""Who holds each tensor after its gather: the trainer ranks any of which may write its bytes.

Pure and deterministic: every rank derives the same answer from every trainer rank's coordinates and
every stage's units (what `DistributedWalk` all-gathers at start-up).

- A dense Megatron tensor of stage s is held, once gathered, by every rank of stage s: each
  data-/context-parallel replica gathers it over its own TP group when a rank of that group sends a
  piece of it, so the replicas' gathers run at once on disjoint groups.
- A routed expert owned by EP rank e is held by every rank of stage s with EP rank e (its ETP group
  gathers it, in every expert-data-parallel replica); experts never hop across EP ranks.
- A tensor that is not split over its group (a norm, a router, an expert whole on its ETP rank) needs no
  gather: every holder has it already.

A unit is never split: the HF tensors one Megatron tensor converts to (q/k/v from linear_qkv, gate/up
from linear_fc1) come out of one conversion on the rank that gathered it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_sync.core.grid import ParallelLayout, TrainerRank

@dataclass(frozen=True)
class SourceUnit:
    """One Megatron tensor of a stage, in walk order, and the HF tensors (name, bytes) it converts to.

    `gather` is the group it is gathered over before conversion ("tp", "etp"), None when every holder
    has it whole; `owner_ep` is the EP rank owning a routed expert (None: dense).
    """

    name: str
    stage: int
    hf: tuple[tuple[str, int], ...]
    owner_ep: Optional[int] = None
    gather: Optional[str] = None

    @property
    def nbytes(self) -> int:
        """Return the HF bytes this unit converts to."""
        return sum(n for _, n in self.hf)

    def to_wire(self) -> list:
        """Return a JSON-able form: [name, stage, [[hf name, bytes], ...], owner_ep, gather]."""
        return [self.name, self.stage, [list(h) for h in self.hf], self.owner_ep, self.gather]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "SourceUnit":
        """Return the unit `to_wire` encoded."""
        name, stage, hf, owner, gather = wire
        return cls(name, stage, tuple((n, b) for n, b in hf), owner, gather)


def source_units(units: Sequence[Any], converter: Any, layout: ParallelLayout) -> list[SourceUnit]:
    """Return a stage's gather units (`gather.GatherUnit`, in walk order) as source units."""
    sizes = {"tp": layout.tp, "etp": layout.etp}
    return [
        SourceUnit(u.name, layout.pp_rank,
                   tuple((m.name, m.nbytes) for m in converter.convert_meta(u.name, u.full_shape, u.dtype)),
                   u.owner_ep, u.sharding.axis if sizes.get(u.sharding.axis, 1) > 1 else None)
        for u in units
    ]


GroupKey = tuple[int, ...]
"""Which group of ranks gathers a unit together: (pp, cp, dp) for dense units, (pp, ep, edp) for experts."""


def group_of(unit: SourceUnit, rank: TrainerRank) -> GroupKey:
    """Return the key of the group `rank` gathers `unit` with (its replica's TP or ETP group)."""
    if unit.owner_ep is None:
        return (rank.pp, rank.cp, rank.dp)
    return (rank.pp, rank.ep, rank.edp)


class Holders:
    """The ranks that may send each unit's outputs, indexed by (stage, EP owner) so a full-scale model's
    hundreds of thousands of units find theirs at once."""

    def __init__(self, ranks: Sequence[TrainerRank]) -> None:
        self.ranks = tuple(sorted(ranks, key=lambda r: r.rank))
        self._by_key: dict[tuple[int, Optional[int]], tuple[TrainerRank, ...]] = {}
        for r in self.ranks:
            self._by_key.setdefault((r.pp, None), ())
            self._by_key[(r.pp, None)] += (r,)
            self._by_key.setdefault((r.pp, r.ep), ())
            self._by_key[(r.pp, r.ep)] += (r,)

    def of(self, unit: SourceUnit) -> tuple[TrainerRank, ...]:
        """Return the ranks that hold `unit` after its gather (ascending rank)."""
        found = self._by_key.get((unit.stage, unit.owner_ep), ())
        if not found:
            raise ValueError(
                f"no trainer rank can hold {unit.name} (stage {unit.stage}, EP owner {unit.owner_ep}); "
                "every trainer rank must take part (the rank list covers every pipeline stage and EP rank)"
            )
        return found
