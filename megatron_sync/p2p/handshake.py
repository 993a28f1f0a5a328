"""The P2P start-up handshake: engines publish their layouts, the trainer its replica, all one plan.

Three all-gathers on the transport group, in the same order on every rank; each carries
errors too, so a rank that fails makes every rank fail at the same step:

1. every inference rank publishes its engine's layout (`LayoutEngine.memory_layout()`);
2. the trainer ranks build the distributed replica (its assignment balances the bytes each
   HF tensor is sent to the fleet those layouts describe) and trainer rank 0 publishes the
   plan inputs: every HF tensor with its shard role, and the trainer rank holding it;
3. every rank builds the transfer plan from those and compares digests (and each inference
   rank checks that the plan carries exactly the tensors its engine loads): any difference
   fails every rank with PlanMismatchError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from megatron_sync.agreement import describe, failures_of
from megatron_sync.errors import AgreedFailure
from megatron_sync.meta import TensorMeta
from megatron_sync.p2p.layout import EngineLayout, TensorSpec, engine_layout_from_wire, specs_from_wire, specs_to_wire
from megatron_sync.p2p.plan import TransferPlan, build_transfer_plan, fleet_receivers
from megatron_sync.plan import agree_on_plan, coverage_problem

if TYPE_CHECKING:
    from megatron_sync.transport.base import Transport


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


def fleet_layouts(published: Sequence[dict], engine_tp_size: int) -> list[EngineLayout]:
    """Return one layout per engine from what each inference rank published, in rank order.

    Engines are runs of `engine_tp_size` consecutive inference ranks (as the inference job
    forms them); every rank of an engine must publish the same layout of that size.
    """
    if len(published) % engine_tp_size:
        raise ValueError(f"{len(published)} inference ranks do not form engines of engine_tp_size={engine_tp_size}")
    engines = []
    for first in range(0, len(published), engine_tp_size):
        ranks = published[first:first + engine_tp_size]
        if any(wire != ranks[0] for wire in ranks):
            raise ValueError(f"the ranks of the engine at inference ranks {first}..{first + engine_tp_size - 1} "
                             f"publish different layouts: {ranks}")
        layout = engine_layout_from_wire(ranks[0])
        if layout.tp_size != engine_tp_size:
            raise ValueError(f"the engine at inference rank {first} has tp_size={layout.tp_size}, but "
                             f"weight_sync.engine_tp_size={engine_tp_size}; make them agree")
        engines.append(layout)
    return engines


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
              layout: Optional[Callable[[], EngineLayout]] = None,
              replica: Optional[Callable[[list[EngineLayout]], Optional[PlanInputs]]] = None,
              expected: Optional[list[TensorMeta]] = None) -> TransferPlan:
    """Run the three steps; return the transfer plan every rank agreed on.

    Inference ranks pass `layout` (their engine's) and `expected` (what it loads); trainer
    ranks pass `replica(engine layouts)`, which builds this rank's replica (collective over
    the trainer job) and returns the plan inputs on trainer rank 0 (None elsewhere).
    """
    published = exchange(transport, "publishing the engines' layouts",
                         lambda: layout().to_wire() if layout is not None else None)
    engines = fleet_layouts(published[num_trainer_ranks:], engine_tp_size)
    inputs = exchange(transport, "building the trainer's distributed replica",
                      lambda: _wire(replica(engines)) if replica is not None else None)[0]
    if inputs is None:
        raise AgreedFailure("P2P start-up: building the trainer's distributed replica",
                            [(0, "trainer rank 0 published no plan inputs")])
    plan_inputs = PlanInputs.from_wire(inputs)
    plan = build_transfer_plan(plan_inputs.specs, plan_inputs.holders,
                               fleet_receivers(plan_inputs.specs, engines), bucket_bytes)
    agree_on_plan(transport, plan.digest(), coverage_problem(list(plan.tensors), expected) if expected else None)
    return plan


def _wire(inputs: Optional[PlanInputs]) -> Optional[dict]:
    return None if inputs is None else inputs.to_wire()
