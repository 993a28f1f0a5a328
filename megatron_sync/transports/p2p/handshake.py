"""The P2P start-up handshake: engines publish their layouts, the trainer its replica, all one plan.

Three all-gathers on the transport group, in the same order on every rank; each carries
errors too, so a rank that fails makes every rank fail at the same step:

1. every inference rank publishes its rank layout (`EngineAdapter.rank_layout()`: its
   params and which region of which HF tensor lands where in them);
2. the trainer ranks build the distributed replica (its assignment balances the bytes each
   HF tensor is sent to the ranks those layouts describe) and trainer rank 0 publishes the
   plan inputs: every HF tensor with its shard role, and the trainer rank holding it;
3. every rank checks every layout against those tensors (a region outside a tensor, a
   dtype that differs, a name the trainer does not produce fails every rank naming it),
   builds the transfer plan and compares digests (and each inference rank checks that the
   plan carries exactly the tensors its engine loads): any difference fails every rank
   with PlanMismatchError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_sync.core.agreement import describe, failures_of
from megatron_sync.core.errors import AgreedFailure
from megatron_sync.layout.rank import RankLayout, specs_from_wire, specs_to_wire
from megatron_sync.layout.regions import TensorSpec
from megatron_sync.core.meta import TensorMeta
from megatron_sync.transports.p2p.plan import TransferPlan, build_transfer_plan, fleet_receivers
from megatron_sync.plan.buckets import coverage_problem
from megatron_sync.transports.buckets.plan_agreement import agree_on_plan

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
class PlanInputs:
    """What trainer rank 0 publishes in step 2: the HF tensors and the trainer rank holding each."""

    specs: list[TensorSpec]
    holders: dict[str, int]

    def to_wire(self) -> dict:
        return {"specs": specs_to_wire(self.specs), "holders": self.holders}

    @classmethod
    def from_wire(cls, wire: dict) -> "PlanInputs":
        return cls(specs_from_wire(wire["specs"]), {name: int(rank) for name, rank in wire["holders"].items()})


def handshake(transport: "Transport", *, num_trainer_ranks: int, engine_tp_size: int, bucket_bytes: int,
              layout: Optional[Callable[[], RankLayout]] = None,
              replica: Optional[Callable[[list[RankLayout]], Optional[PlanInputs]]] = None,
              expected: Optional[list[TensorMeta]] = None) -> TransferPlan:
    """Run the three steps; return the transfer plan every rank agreed on.

    Inference ranks pass `layout` (their rank's) and `expected` (what their engine loads);
    trainer ranks pass `replica(rank layouts)`, which builds this rank's replica (collective
    over the trainer job) and returns the plan inputs on trainer rank 0 (None elsewhere).
    `engine_tp_size` groups inference ranks into engines (labels in the plan only).
    """
    published = exchange(transport, "publishing the engines' layouts",
                         lambda: layout().to_wire() if layout is not None else None)
    layouts = [RankLayout.from_wire(wire) for wire in published[num_trainer_ranks:]]
    inputs = exchange(transport, "building the trainer's distributed replica",
                      lambda: _wire(replica(layouts)) if replica is not None else None)[0]
    if inputs is None:
        raise AgreedFailure("P2P start-up: building the trainer's distributed replica",
                            [(0, "trainer rank 0 published no plan inputs")])
    plan_inputs = PlanInputs.from_wire(inputs)
    specs = {s.name: s for s in plan_inputs.specs}
    for index, rank_layout in enumerate(layouts):  # the same check, and error, on every rank
        rank_layout.check_against(specs, who=f"inference rank {index}")
    plan = build_transfer_plan(plan_inputs.specs, plan_inputs.holders,
                               fleet_receivers(layouts, engine_tp_size), bucket_bytes)
    agree_on_plan(transport, plan.digest(), coverage_problem(list(plan.tensors), expected) if expected else None)
    return plan


def _wire(inputs: Optional[PlanInputs]) -> Optional[dict]:
    return None if inputs is None else inputs.to_wire()
