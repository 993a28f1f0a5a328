"""Which trainer rank gathers, converts and holds each Megatron tensor: the distributed replica.

Pure and deterministic: every rank computes the same assignment from the same inputs (the
stage's gather units with their HF outputs' sizes, and every trainer rank's coordinates).

- A routed expert goes to a rank of the EP rank that owns it (any of its ETP ranks, in any
  expert-DP replica): its shards are gathered over ETP only and never hop across EP.
- A dense tensor goes to any rank of its pipeline stage (TP x CP x DP): it is gathered over
  the TP group of the chosen rank's replica, so the gathers of different replicas run at once.
- A unit is never split: the HF tensors one Megatron tensor converts to (q/k/v from
  linear_qkv, gate/up from linear_fc1) stay together, since they are converted together.
- Balance: experts first (they have fewer choices), then dense units, each in descending
  cost to the least-loaded candidate (ties: lowest rank). The cost defaults to the unit's
  HF bytes (host memory); pass the bytes each HF tensor is sent to balance the sending instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from megatron_sync.core.grid import ParallelLayout

_AXES = ("pp", "tp", "cp", "dp", "ep", "etp", "edp")


@dataclass(frozen=True)
class TrainerRank:
    """One trainer rank: its global rank and its coordinates in Megatron's dense and expert grids."""

    rank: int
    pp: int = 0
    tp: int = 0
    cp: int = 0
    dp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int) -> "TrainerRank":
        """Return the coordinates of global rank `rank` whose parallel layout is `layout`."""
        return cls(rank, **{axis: getattr(layout, f"{axis}_rank") for axis in _AXES})

    def to_wire(self) -> list[int]:
        """Return a JSON-able form: [rank, pp, tp, cp, dp, ep, etp, edp]."""
        return [self.rank, *(getattr(self, axis) for axis in _AXES)]

    @classmethod
    def from_wire(cls, wire: Sequence[int]) -> "TrainerRank":
        """Return the rank `to_wire` encoded."""
        return cls(*wire)


@dataclass(frozen=True)
class ReplicaUnit:
    """One Megatron tensor of a stage and the HF tensors (name, bytes) it converts to."""

    name: str
    stage: int
    hf: tuple[tuple[str, int], ...]
    owner_ep: int | None = None  # routed experts: the EP rank that holds them

    @property
    def nbytes(self) -> int:
        """Return the HF bytes this unit converts to."""
        return sum(n for _, n in self.hf)

    def to_wire(self) -> list:
        """Return a JSON-able form: [name, stage, [[hf name, bytes], ...], owner_ep]."""
        return [self.name, self.stage, [list(h) for h in self.hf], self.owner_ep]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "ReplicaUnit":
        """Return the unit `to_wire` encoded."""
        name, stage, hf, owner = wire
        return cls(name, stage, tuple((n, b) for n, b in hf), owner)


@dataclass(frozen=True)
class ReplicaAssignment:
    """The holder (global trainer rank) of every unit, and what each rank holds."""

    units: tuple[ReplicaUnit, ...]
    holders: tuple[int, ...]  # parallel to units
    ranks: tuple[TrainerRank, ...]

    def holder_of(self) -> dict[str, int]:
        """Return Megatron unit name -> holder rank."""
        return {u.name: h for u, h in zip(self.units, self.holders)}

    def hf_holders(self) -> dict[str, int]:
        """Return HF tensor name -> the trainer rank that holds (and sends) it."""
        return {name: h for u, h in zip(self.units, self.holders) for name, _ in u.hf}

    def bytes_per_rank(self) -> dict[int, int]:
        """Return the HF bytes each trainer rank converts and holds (every rank listed)."""
        held = {r.rank: 0 for r in self.ranks}
        for unit, holder in zip(self.units, self.holders):
            held[holder] += unit.nbytes
        return held

    def digest(self) -> str:
        """Return the sha256 of a canonical encoding (compare across ranks before any data moves)."""
        canonical = [[u.to_wire() for u in self.units], list(self.holders), [r.to_wire() for r in self.ranks]]
        return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()

    def report(self) -> str:
        """Return one line per trainer rank: its coordinates, units and bytes held."""
        held = self.bytes_per_rank()
        count = {r.rank: 0 for r in self.ranks}
        for holder in self.holders:
            count[holder] += 1
        lines = []
        for r in self.ranks:
            where = " ".join(f"{axis}{getattr(r, axis)}" for axis in _AXES)
            lines.append(f"trainer rank {r.rank} ({where}): {count[r.rank]} tensors, {held[r.rank]} bytes")
        return "\n".join(lines)


def candidates(unit: ReplicaUnit, ranks: Sequence[TrainerRank]) -> list[TrainerRank]:
    """Return the ranks that may hold `unit`: its stage's ranks, of its owning EP rank for experts."""
    found = [r for r in ranks if r.pp == unit.stage and (unit.owner_ep is None or r.ep == unit.owner_ep)]
    if not found:
        raise ValueError(
            f"no trainer rank can hold {unit.name} (stage {unit.stage}, EP owner {unit.owner_ep}); "
            "the rank list must cover every pipeline stage and EP rank"
        )
    return found


def assign_replica(units: Sequence[ReplicaUnit], ranks: Sequence[TrainerRank], *,
                   cost: Mapping[str, int] | None = None) -> ReplicaAssignment:
    """Return the holder of every unit, balancing `cost` (per HF name; default: HF bytes) per rank."""
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("unit names must be unique across stages")
    ranks = tuple(sorted(ranks, key=lambda r: r.rank))

    def unit_cost(u: ReplicaUnit) -> int:
        return u.nbytes if cost is None else sum(cost[name] for name, _ in u.hf)

    order = sorted(range(len(units)), key=lambda i: (units[i].owner_ep is None, -unit_cost(units[i]), i))
    load = {r.rank: 0 for r in ranks}
    holders: list[int | None] = [None] * len(units)
    for i in order:
        best = min(candidates(units[i], ranks), key=lambda r: (load[r.rank], r.rank))
        holders[i] = best.rank
        load[best.rank] += unit_cost(units[i])
    return ReplicaAssignment(tuple(units), tuple(holders), ranks)
