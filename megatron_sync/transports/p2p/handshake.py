"""The P2P start-up handshake: engines publish their layouts, the trainer its ranks and units, all one schedule.

Two all-gathers on the transport group, in the same order on every rank; each carries errors too, so a
rank that fails makes every rank fail at the same step:

1. every inference rank publishes its rank layout (`EngineAdapter.rank_layout()`: its params and which
   region of which HF tensor lands where in them) and whether its engine copies every version (`copies_shards`);
2. every trainer rank publishes its coordinates; each stage's source rank its stage's units in walk order
   (the HF tensors each converts to); trainer rank 0 the HF tensor specs and the schedule options (the
   trainer's settings: the inference job adopts them).

Then every rank checks every layout against the specs (a region outside a tensor, a dtype that differs, a
name the trainer does not produce fails every rank naming it), builds the schedule and compares digests
(each inference rank also checks the schedule carries exactly the tensors its engine loads): any difference
fails every rank with PlanMismatchError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_sync.core.grid import TrainerRank
from megatron_sync.core.agreement import describe, failures_of
from megatron_sync.core.errors import AgreedFailure
from megatron_sync.core.meta import TensorMeta
from megatron_sync.layout.rank import RankLayout, specs_from_wire, specs_to_wire
from megatron_sync.layout.regions import TensorSpec
from megatron_sync.plan.buckets import coverage_problem
from megatron_sync.transports.buckets.plan_agreement import agree_on_plan
from megatron_sync.transports.p2p.build import build_schedule
from megatron_sync.transports.p2p.holders import SourceUnit
from megatron_sync.transports.p2p.schedule import Schedule, ScheduleOptions, inference_ranks

if TYPE_CHECKING:
    from megatron_sync.transports.base import Transport


def exchange(transport: "Transport", what: str, produce: Callable[[], Any]) -> list[Any]:
    """Return every transport rank's `produce()`, by rank; if any rank's raised, raise on every rank.

    `produce` returns something JSON-serialisable (None where a rank has nothing to say).
    """
    try:
        mine = [None, produce()]
    except Exception as e:  # noqa: BLE001 — shared, then raised on every rank
        mine = [describe(e, limit=4), None]
    everyone = transport.all_gather_json(mine)
    failures = failures_of([error for error, _ in everyone])
    if failures:
        raise AgreedFailure(f"P2P start-up: {what}", failures)
    return [value for _, value in everyone]


@dataclass(frozen=True)
class TrainerSide:
    """What one trainer rank publishes in step 2 (units: its stage's, on the stage's source; specs and
    options: on trainer rank 0)."""

    rank: TrainerRank
    units: Optional[list[SourceUnit]] = None
    specs: Optional[list[TensorSpec]] = None
    options: Optional[ScheduleOptions] = None

    def to_wire(self) -> dict:
        return {"rank": self.rank.to_wire(), "units": None if self.units is None else [u.to_wire() for u in self.units],
                "specs": None if self.specs is None else specs_to_wire(self.specs),
                "options": None if self.options is None else self.options.to_wire()}

    @classmethod
    def from_wire(cls, wire: dict) -> "TrainerSide":
        return cls(TrainerRank.from_wire(wire["rank"]),
                   None if wire["units"] is None else [SourceUnit.from_wire(u) for u in wire["units"]],
                   None if wire["specs"] is None else specs_from_wire(wire["specs"]),
                   None if wire["options"] is None else ScheduleOptions(*wire["options"]))


def handshake(transport: "Transport", *, num_trainer_ranks: int, engine_tp_size: int,
              layout: Optional[Callable[[], RankLayout]] = None,
              trainer: Optional[Callable[[], TrainerSide]] = None,
              expected: Optional[list[TensorMeta]] = None, copies: bool = False) -> Schedule:
    """Run both steps; return the schedule every rank agreed on.

    Inference ranks pass `layout` (their rank's), `expected` (what their engine loads) and `copies` (whether
    their engine copies every version into weights of its own: the trainer's `staging_sets: auto` is 1 when
    every engine does, else 2); trainer ranks pass `trainer()`, what they publish. `engine_tp_size` groups
    inference ranks into engines.
    """
    published = exchange(transport, "publishing the engines' layouts",
                         lambda: [layout().to_wire(), copies] if layout is not None else None)
    layouts = [RankLayout.from_wire(wire) for wire, _ in published[num_trainer_ranks:]]
    sides = [TrainerSide.from_wire(w) for w in exchange(
        transport, "publishing the trainer's ranks and units",
        lambda: trainer().to_wire() if trainer is not None else None)[:num_trainer_ranks]]
    first = sides[0]
    if first.specs is None or first.options is None:
        raise AgreedFailure("P2P start-up: publishing the trainer's ranks and units",
                            [(0, "trainer rank 0 published no tensor specs or schedule options")])
    specs = {s.name: s for s in first.specs}
    for index, rank_layout in enumerate(layouts):  # the same check, and error, on every rank
        rank_layout.check_against(specs, who=f"inference rank {index}")
    units = [u for side in sorted(sides, key=lambda s: s.rank.pp) if side.units for u in side.units]
    options = first.options.resolved(copies=all(copy for _, copy in published[num_trainer_ranks:]))
    schedule = build_schedule(units, [s.rank for s in sides], first.specs, inference_ranks(layouts, engine_tp_size),
                              options)
    agree_on_plan(transport, schedule.digest(), coverage_problem(list(schedule.tensors), expected) if expected else None)
    return schedule
