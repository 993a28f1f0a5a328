"""The scale model's one adapter to the project's planners: every call into the transports' planners is here.

From an HF config and the two layouts, on metadata only (meta-device tensors, `TensorMeta`), it runs
what the real sync runs at start-up and summarises, per transport, what each sender and each
receiver moves (`scale.summary`):

- the converter (`megatron_sync.convert`): the HF checkpoint's tensors, shard roles, quantized outputs;
- the Megatron side (`scale.megatron_side`): every stage's gather units from `gather.plan_gather_units`;
- broadcast: `plan.build_plan` (buckets per stage, keep-together groups);
- P2P: `p2p.replica.replica_units` + `p2p.assign.assign_replica` (the distributed replica) and
  `p2p.plan.build_transfer_plan` over the engines' role-based layouts (`layout.roles.RoleLayout`);
- disk-delta: `delta.chain.plan_chain` (what a reader applies per sync) and the writer's chunking;
- colocated IPC at scale (a design, not the built transport): the P2P plan with each inference rank on the
  trainer GPU of its number. The built `transport: ipc` hands each stage source's buckets to the engine
  ranks of its own host through one shared segment; it is not modelled across hosts.

Full-scale fast paths (each proven equal to the full planner on mid-size cases by tests/test_scale_plans.py):
the fleet's engines are identical and tensors of one kind are cut alike, so the transfer plan's totals
are computed once per engine and tensor kind without `Range` objects; the replica assignment indexes
candidates by (stage, EP owner) instead of scanning every rank per unit (`assign_balanced`).
"""

from __future__ import annotations

import copy
import time
import tracemalloc
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Sequence

from megatron_sync.transports.disk_delta.chain import Held, VersionInfo, plan_chain
from megatron_sync.transports.disk_delta.options import WriterOptions
from megatron_sync.trainer.gather import GatherUnit
from megatron_sync.layout.rank import Placement
from megatron_sync.layout.regions import VOCAB_BLOCKS, VOCAB_WHOLE, Region, Sharding, TensorSpec
from megatron_sync.layout.roles import RoleLayout
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.transports.p2p.assign import ReplicaAssignment, ReplicaUnit, TrainerRank, assign_replica, candidates
from megatron_sync.transports.p2p.plan import Receiver, build_transfer_plan, send_bytes_per_tensor
from megatron_sync.transports.p2p.replica import replica_units
from megatron_sync.plan.buckets import build_plan
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.megatron_side import flows, stage_units
from megatron_sync.scale.models import converter_for
from megatron_sync.scale.summary import Endpoint, PlanSummary, Traffic

TRANSPORTS = ("broadcast", "p2p", "disk_delta", "ipc")


# ---------------------------------------------------------------- engine layouts (role-based)


def engine_layout(fleet: FleetLayout, num_kv_heads: int) -> RoleLayout:
    """Return the role-based layout of one engine of `fleet` (vocabulary in padded blocks unless the
    engine keeps it whole, routed experts whole on their EP rank with expert parallelism)."""
    sharding = Sharding(fleet.tp, num_kv_heads=num_kv_heads, vocab=VOCAB_BLOCKS if fleet.vocab_parallel else VOCAB_WHOLE)
    return RoleLayout(sharding, expert_parallel=fleet.expert_parallel)


def _nbytes(region: Region, spec: TensorSpec) -> int:
    return region.numel * spec.dtype.itemsize


class RegionTable:
    """Every HF tensor's region on every rank of one engine, computed once per kind of tensor: tensors of
    equal shape, dtype, role and quantization cut (and, with expert parallelism, equal expert) get equal
    regions."""

    def __init__(self, layout: RoleLayout, specs: Sequence[TensorSpec], ranks: int):
        self.specs, self.ranks = list(specs), ranks
        num_experts = 1 + max((s.expert for s in self.specs if s.expert is not None), default=-1)
        cache: dict[tuple, list[Region | None]] = {}
        self.kind: list[tuple] = []
        for spec in self.specs:
            key = (spec.shape, spec.dtype, spec.role, spec.weight_shape, spec.unit, spec.whole,
                   spec.expert if layout.expert_parallel else None)
            if key not in cache:
                cache[key] = [layout.region(spec, r, num_experts) for r in range(ranks)]
            self.kind.append(key)
        self.regions = cache

    def of(self, i: int) -> list[Region | None]:
        """Return spec i's region on each rank (None: the rank holds none of it)."""
        return self.regions[self.kind[i]]

    def shard_totals(self) -> tuple[list[int], list[int]]:
        """Return per rank its shard bytes and HF tensors."""
        nbytes, tensors = [0] * self.ranks, [0] * self.ranks
        count: dict[tuple, int] = defaultdict(int)
        example: dict[tuple, TensorSpec] = {}
        for spec, kind in zip(self.specs, self.kind):
            count[kind] += 1
            example.setdefault(kind, spec)
        for kind, n in count.items():
            for r, region in enumerate(self.regions[kind]):
                if region is not None:
                    nbytes[r] += n * _nbytes(region, example[kind])
                    tensors[r] += n
        return nbytes, tensors

    def sent_bytes(self) -> dict[str, int]:
        """Return the bytes each HF tensor is sent to one engine (its holder's sending cost)."""
        per_kind: dict[tuple, int] = {}
        for spec, kind in zip(self.specs, self.kind):
            if kind not in per_kind:
                per_kind[kind] = sum(_nbytes(r, spec) for r in self.regions[kind] if r is not None)
        return {spec.name: per_kind[kind] for spec, kind in zip(self.specs, self.kind)}


# ---------------------------------------------------------------- the planner


class ScalePlanner:
    """Plans one sync of a model between two layouts, on metadata, with the project's planners."""

    def __init__(self, family: str, hf_config: dict, trainer: TrainerLayout, fleet: FleetLayout, *,
                 dtype: str = "bfloat16", train_dtype: str = "bfloat16", draft: bool = True):
        self.trainer, self.fleet = trainer, fleet
        started = time.perf_counter()
        self.converter = converter_for(family, hf_config, dtype=dtype, draft=draft)
        self.specs: list[TensorSpec] = self.converter.tensor_specs()
        self.units = stage_units(self.converter, trainer, dtype_from_name(train_dtype))
        outputs = {u.name: self.converter.convert_meta(u.name, u.full_shape, u.dtype) for us in self.units for u in us}
        self.unit_hf_bytes = {name: sum(m.nbytes for m in metas) for name, metas in outputs.items()}
        self._known = _KnownOutputs(outputs)
        self.stage_metas = [[m for u in units for m in outputs[u.name]] for units in self.units]
        self.converter.check_complete(m.name for metas in self.stage_metas for m in metas)
        self.engine = engine_layout(fleet, self.converter.config.get("num_key_value_heads") or 1)
        self.regions = RegionTable(self.engine, self.specs, fleet.tp)
        self._shards: tuple[list[int], list[int]] | None = None
        self._source_traffic: dict[int, Traffic] | None = None
        self.stage_bytes = [sum(m.nbytes for m in metas) for metas in self.stage_metas]
        self.setup_seconds = time.perf_counter() - started

    @property
    def model_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def shard_bytes(self) -> tuple[list[int], list[int]]:
        """Return per inference rank (the whole fleet) its shard bytes and HF tensors (from its layout)."""
        if self._shards is None:
            self._shards = self.regions.shard_totals()
        nbytes, tensors = self._shards
        return nbytes * self.fleet.engines, tensors * self.fleet.engines

    def _to_stage_sources(self) -> dict[int, Traffic]:
        """Return the gather traffic of the bucket transports (every unit to its stage's source), once."""
        if self._source_traffic is None:
            self._source_traffic = self._gather_traffic(lambda unit, stage: self.trainer.stage_source(stage))
        return copy.deepcopy(self._source_traffic)

    def plan(self, transport: str, *, bucket_bytes: int, measure_memory: bool = False, **options) -> PlanSummary:
        """Return the summary of `transport`'s plan, with its own cost (seconds; peak bytes if measured)."""
        build = {"broadcast": self._broadcast, "p2p": self._p2p, "disk_delta": self._disk_delta,
                 "ipc": self._ipc}.get(transport)
        if build is None:
            raise ValueError(f"transport {transport!r} has no plan here; use one of {list(TRANSPORTS)}")
        if measure_memory:
            tracemalloc.start()
        started = time.perf_counter()
        try:
            summary = build(bucket_bytes, **options)
        finally:
            peak = tracemalloc.get_traced_memory()[1] if measure_memory else None
            if measure_memory:
                tracemalloc.stop()
        summary.seconds, summary.peak_bytes = time.perf_counter() - started, peak
        return summary

    # ---- broadcast: one source per stage, every inference rank receives every bucket

    def _broadcast(self, bucket_bytes: int) -> PlanSummary:
        plan = build_plan(self.stage_metas, bucket_bytes, self.converter.keep_together)
        senders, stage_of = [], {}
        for stage in range(self.trainer.pp):
            buckets = plan.for_stage(stage)
            rank = self.trainer.stage_source(stage)
            stage_of[rank] = stage
            senders.append(Endpoint(rank, self.trainer.node_of(rank), sum(b.nbytes for b in buckets),
                                    sum(len(b.entries) for b in buckets), len(buckets),
                                    max((e.nbytes for b in buckets for e in b.entries), default=0),
                                    self.fleet.ranks))
        largest = max(s.largest for s in senders)
        receivers = [Endpoint(r, self.fleet.node_of(r), plan.total_bytes, len(self.specs), len(plan.buckets),
                              largest, len(senders)) for r in range(self.fleet.ranks)]
        shard, shard_tensors = self.shard_bytes()
        return PlanSummary("broadcast", self.trainer, self.fleet, self.model_bytes, len(self.specs), bucket_bytes, senders, receivers,
                           self._to_stage_sources(), shard, shard_tensors, stage_of, {"buckets": len(plan.buckets),
                                                            "max_bucket": plan.max_bucket_bytes})

    # ---- P2P: every trainer rank holds a share and writes straight into the receivers' staging memory

    def assignment(self, fast: bool = True) -> ReplicaAssignment:
        """Return the distributed replica's assignment, balanced by bytes sent to the whole fleet."""
        units = [u for stage, us in enumerate(self.units) for u in replica_units(us, self._known, stage)]
        per_engine = (self.regions.sent_bytes() if fast else
                      send_bytes_per_tensor(self.specs, [r.layout for r in self._one_engine()]))
        cost = {name: sent * self.fleet.engines for name, sent in per_engine.items()}
        assign = assign_balanced if fast else assign_replica
        return assign(units, self.trainer.ranks(), cost=cost)

    def _one_engine(self) -> list[Receiver]:
        return [Receiver(0, r, self.engine.rank_layout(self.specs, r)) for r in range(self.fleet.tp)]

    def _p2p(self, bucket_bytes: int, fast: bool = True, colocated: bool = False) -> PlanSummary:
        assignment = self.assignment(fast)
        holders = assignment.hf_holders()
        if fast:
            senders, recv, pair_bytes = _fast_transfer_totals(self.specs, self.regions, holders, self.fleet,
                                                              bucket_bytes)
        else:
            layouts = [receiver.layout for receiver in self._one_engine()]
            receivers = [Receiver(e, r, layout) for e in range(self.fleet.engines) for r, layout in enumerate(layouts)]
            plan = build_transfer_plan(self.specs, holders, receivers, bucket_bytes)
            senders, recv = _transfer_totals(plan, 1, self.fleet.tp, self.fleet.ranks)
            pair_bytes = defaultdict(int)
            for r in plan.ranges:
                pair_bytes[(r.sender, r.receiver)] += r.nbytes
        node_of_receiver = self.trainer.node_of if colocated else self.fleet.node_of
        for s in senders.values():
            s.node = self.trainer.node_of(s.rank)
        for r in recv:
            r.node = node_of_receiver(r.rank)
        holder_of = assignment.holder_of()
        gather = self._gather_traffic(lambda unit, stage: holder_of[unit.name])
        shard, shard_tensors = self.shard_bytes()
        local = sum(n for (sender, receiver), n in pair_bytes.items()
                    if self.trainer.node_of(sender) == node_of_receiver(receiver))
        extra = {"ranges": sum(r.tensors for r in recv), "messages": sum(r.messages for r in recv),
                 "local_bytes": local}
        return PlanSummary("ipc" if colocated else "p2p", self.trainer, self.fleet, self.model_bytes,
                           len(self.specs), bucket_bytes, sorted(senders.values(), key=lambda e: e.rank), recv,
                           gather, shard, shard_tensors, extra=extra)

    def _ipc(self, bucket_bytes: int, fast: bool = True) -> PlanSummary:
        if self.fleet.ranks != self.trainer.world:
            raise ValueError(f"colocated ipc runs every inference rank on a trainer GPU: the fleet has "
                             f"{self.fleet.ranks} ranks, the trainer {self.trainer.world}; make them equal")
        return self._p2p(bucket_bytes, fast, colocated=True)

    # ---- disk-delta: stage sources publish deltas to shared storage, one applier per inference host reads

    def _disk_delta(self, bucket_bytes: int, delta_fraction: float = 0.03, snapshot_every: int = 10,
                    versions_behind: int = 1) -> PlanSummary:
        options = WriterOptions(snapshot_every=snapshot_every)
        steps = _steady_chain(snapshot_every, versions_behind)
        senders = []
        for stage, metas in enumerate(self.stage_metas):
            rank = self.trainer.stage_source(stage)
            sizes = [m.nbytes for m in metas]
            chunks = sum(max(1, -(-n // options.chunk_bytes)) for n in sizes)
            senders.append(Endpoint(rank, self.trainer.node_of(rank), int(self.stage_bytes[stage] * delta_fraction),
                                    len(metas), chunks, max(sizes), self.fleet.nodes))
        read = sum(int(s.bytes * (len(steps.steps))) for s in senders)
        hosts = [Endpoint(n * self.fleet.gpus_per_node, n, read, len(self.specs),
                          sum(s.messages for s in senders) * len(steps.steps), max(s.largest for s in senders),
                          len(senders)) for n in range(self.fleet.nodes)]
        shard, shard_tensors = self.shard_bytes()
        return PlanSummary("disk_delta", self.trainer, self.fleet, self.model_bytes, len(self.specs), options.chunk_bytes, senders, hosts,
                           self._to_stage_sources(), shard, shard_tensors, {s.rank: i for i, s in enumerate(senders)},
                           {"delta_fraction": delta_fraction, "chain": [(s.version, s.part) for s in steps.steps],
                            "raw_stage_bytes": list(self.stage_bytes)})

    # ---- gather traffic, for any destination of each unit

    def _gather_traffic(self, destination: Callable[[GatherUnit, int], int]) -> dict[int, Traffic]:
        """Return per trainer rank the bytes its gathers move: shards of each unit reach the unit's
        destination rank (a TP group's peers, or the owning EP rank's ETP peers and then, for the
        bucket transports, that owner's first rank sends the experts on to the stage source)."""
        t, traffic = self.trainer, defaultdict(Traffic)
        converts = defaultdict(int)
        for stage, units in enumerate(self.units):
            for unit in units:
                dst = destination(unit, stage)
                hops = flows(unit, stage, dst, t)
                if any(to == dst and nbytes < unit.nbytes for _, to, nbytes in hops):
                    traffic[dst].merged += unit.nbytes
                for src, to, nbytes in hops:
                    inter = t.node_of(src) != t.node_of(to)
                    traffic[src].out_inter += nbytes if inter else 0
                    traffic[src].out_intra += 0 if inter else nbytes
                    traffic[to].in_inter += nbytes if inter else 0
                    traffic[to].in_intra += 0 if inter else nbytes
                traffic[dst].units += 1
                converts[dst] += self.unit_hf_bytes[unit.name]
        for rank, nbytes in converts.items():
            traffic[rank].converted = nbytes
        return dict(traffic)


class _KnownOutputs:
    """`convert_meta` answered from the outputs the planner already computed (planners that take a
    converter ask it once more per unit)."""

    def __init__(self, outputs: dict[str, list[Any]]):
        self._outputs = outputs

    def convert_meta(self, name: str, shape: Any, dtype: Any) -> list[Any]:
        return self._outputs[name]


def _transfer_totals(plan: Any, repeat: int, engine_ranks: int, fleet_ranks: int) -> tuple[dict[int, Endpoint], list[Endpoint]]:
    """Return per-sender and per-receiver totals of a full transfer plan (`repeat` 1: every receiver in it)."""
    senders: dict[int, Endpoint] = {}
    receivers = [Endpoint(r, 0) for r in range(len(plan.receivers))]
    pairs: set[tuple[int, int]] = set()
    for r in plan.ranges:
        s = senders.get(r.sender)
        if s is None:
            s = senders[r.sender] = Endpoint(r.sender, 0)
        rec = receivers[r.receiver]
        s.bytes += r.nbytes
        s.tensors += 1
        rec.bytes += r.nbytes
        rec.tensors += 1
        s.largest = max(s.largest, r.nbytes)
        rec.largest = max(rec.largest, r.nbytes)
        pairs.add((r.sender, r.receiver))
    for m in plan.messages:
        senders[m.sender].messages += 1
        receivers[m.receiver].messages += 1
    for sender, receiver in pairs:
        senders[sender].peers += 1
        receivers[receiver].peers += 1
    return senders, receivers


def _fast_transfer_totals(specs: Sequence[TensorSpec], regions: RegionTable, holders: dict[str, int],
                          fleet: FleetLayout, bucket_bytes: int):
    """Return what `_transfer_totals(build_transfer_plan(...))` returns for the whole fleet, and the bytes per
    (sender, receiver) pair, without building ranges: every engine is the same, so one engine's totals
    stand for all; a tensor kind's row ranges on a rank (`p2p.plan._row_ranges`) are cut once; messages
    are packed per pair in plan order exactly as `p2p.plan._messages` packs them."""
    from megatron_sync.transports.p2p.plan import _row_ranges

    cut: dict[tuple, list[int]] = {}
    senders: dict[int, Endpoint] = {}
    receivers = [Endpoint(r, 0) for r in range(regions.ranks)]
    open_bytes: dict[tuple[int, int], int] = {}  # pair -> bytes of its message being packed
    pair_bytes: dict[tuple[int, int], int] = defaultdict(int)
    for i, spec in enumerate(specs):
        sender = holders[spec.name]
        s = senders.get(sender)
        if s is None:
            s = senders[sender] = Endpoint(sender, 0)
        for rank, region in enumerate(regions.of(i)):
            if region is None:
                continue
            key = (regions.kind[i], rank)
            sizes = cut.get(key)
            if sizes is None:
                placement = Placement(spec.name, region, spec.name, 0, _nbytes(region, spec))
                sizes = cut[key] = [n for _, _, _, n in _row_ranges(spec, placement, bucket_bytes)]
            rec, pair = receivers[rank], (sender, rank)
            for n in sizes:
                s.bytes += n
                s.tensors += 1
                rec.bytes += n
                rec.tensors += 1
                s.largest = max(s.largest, n)
                rec.largest = max(rec.largest, n)
                pair_bytes[pair] += n
                held = open_bytes.get(pair)
                if held is None or held + n > bucket_bytes:
                    s.messages += 1
                    rec.messages += 1
                    open_bytes[pair] = n
                else:
                    open_bytes[pair] = held + n
    for sender, rank in pair_bytes:
        senders[sender].peers += 1
        receivers[rank].peers += 1
    for s in senders.values():
        s.bytes, s.tensors, s.messages, s.peers = (v * fleet.engines for v in (s.bytes, s.tensors, s.messages, s.peers))
    fleet_receivers = [replace(receivers[r % regions.ranks], rank=r) for r in range(fleet.ranks)]
    fleet_pairs = {(sender, rank + e * regions.ranks): n for (sender, rank), n in pair_bytes.items()
                   for e in range(fleet.engines)}
    return senders, fleet_receivers, fleet_pairs


def _steady_chain(snapshot_every: int, behind: int):
    """Return what a reader `behind` versions behind applies, from `plan_chain` over a store whose
    versions 1..n carry a delta each and a snapshot every `snapshot_every`-th."""
    target = max(snapshot_every + behind, 2)
    published = {v: VersionInfo(v, f"s{v}", v == 1 or v % snapshot_every == 1, None if v == 1 else v - 1,
                                None if v == 1 else f"s{v - 1}") for v in range(1, target + 1)}
    held = Held(target - behind, f"s{target - behind}")
    return plan_chain(published, held, target)


# ---------------------------------------------------------------- fast replica assignment


def assign_balanced(units: Sequence[ReplicaUnit], ranks: Sequence[TrainerRank], *,
                    cost: dict[str, int] | None = None) -> ReplicaAssignment:
    """Return what `assign_replica` returns, with candidates indexed by (stage, EP owner) once instead of
    scanned per unit, and each group's least-loaded rank kept in a heap (ties: lowest rank)."""
    import heapq

    ranks = tuple(sorted(ranks, key=lambda r: r.rank))
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("unit names must be unique across stages")

    def unit_cost(u: ReplicaUnit) -> int:
        return u.nbytes if cost is None else sum(cost[name] for name, _ in u.hf)

    order = sorted(range(len(units)), key=lambda i: (units[i].owner_ep is None, -unit_cost(units[i]), i))
    load = {r.rank: 0 for r in ranks}
    heaps: dict[tuple, list] = {}
    holders: list[int | None] = [None] * len(units)
    for i in order:
        unit = units[i]
        key = (unit.stage, unit.owner_ep)
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(0, r.rank) for r in candidates(unit, ranks)]
            heapq.heapify(heap)
        while True:  # a rank's load may have grown through another group: refresh stale entries
            held, rank = heap[0]
            if held == load[rank]:
                break
            heapq.heapreplace(heap, (load[rank], rank))
        holders[i] = rank
        load[rank] += unit_cost(unit)
        heapq.heapreplace(heap, (load[rank], rank))
    return ReplicaAssignment(tuple(units), tuple(holders), ranks)


__all__ = ["ScalePlanner", "PlanSummary", "Endpoint", "Traffic", "engine_layout", "RegionTable", "assign_balanced",
           "TRANSPORTS"]
