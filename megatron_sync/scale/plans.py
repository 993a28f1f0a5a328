"""The scale model's one adapter to the project's planners: every call into the transports' planners is here.

From an HF config and the two layouts, on metadata only (meta-device tensors, `TensorMeta`), it runs
what the real sync runs at start-up and summarises, per transport, what each sender and each
receiver moves (`scale.summary`):

- the converter (`megatron_sync.convert`): the HF checkpoint's tensors, shard roles, quantized outputs;
- the Megatron side (`scale.megatron_side`): every stage's gather units from `gather.plan_gather_units`;
- broadcast, and colocated `ipc` on one host: `plan.build_plan` (buckets per stage, keep-together groups);
  ipc hands the same buckets to the engine ranks of the stage source's host through shared memory;
- P2P (device-direct): `transports.p2p.holders` + `balance` (`scale.p2p_plan`) over the engines'
  role-based layouts (`scale.layouts.EngineLayout`);
- disk-delta: `delta.chain.plan_chain` (what a reader applies per sync) and the writer's chunking.

The fleet's engines are identical and tensors of one kind are cut alike, so the engines' regions are
computed once per tensor kind (`RegionTable`).
"""

from __future__ import annotations

import copy
import json
import time
import tracemalloc
from collections import defaultdict
from typing import Any, Callable, Sequence

from megatron_sync.core.bulk import without_gc
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.layout.regions import Region, TensorSpec
from megatron_sync.plan.buckets import build_plan
from megatron_sync.trainer.gather import GatherUnit
from megatron_sync.transports.disk_delta.chain import Held, VersionInfo, plan_chain
from megatron_sync.transports.disk_delta.options import WriterOptions
from megatron_sync.scale.layouts import EngineLayout, FleetLayout, TrainerLayout
from megatron_sync.scale.megatron_side import HF_LAYER, flows, stage_units
from megatron_sync.scale.models import converter_for
from megatron_sync.scale.p2p_plan import P2POptions, endpoints, plan_p2p
from megatron_sync.scale.summary import Endpoint, PlanSummary, Traffic

TRANSPORTS = ("broadcast", "p2p", "disk_delta", "ipc")


def _nbytes(region: Region, spec: TensorSpec) -> int:
    return region.numel * spec.dtype.itemsize


class RegionTable:
    """Every HF tensor's region on every rank of one engine, computed once per kind of tensor: tensors of
    equal shape, dtype, role and quantization cut (and, with expert parallelism, equal expert) get equal
    regions."""

    def __init__(self, layout: EngineLayout, specs: Sequence[TensorSpec], ranks: int):
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


_MODELS: dict[str, tuple] = {}


def _model(family: str, hf_config: Any, dtype: str, draft: bool) -> tuple[Any, list[TensorSpec], Callable]:
    """Return (the converter, the engine's tensor specs, a memoised convert_meta) of one model, built once per
    process: planners of one model over several layouts (the published rows, `make scale`'s sweeps) share it."""
    config = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    key = json.dumps([family, config, dtype, draft], sort_keys=True, default=str)
    if key not in _MODELS:
        converter = converter_for(family, config, dtype=dtype, draft=draft)
        memo: dict = {}

        def converted(name: str, shape: tuple, dtype_) -> list:
            if (name, shape, dtype_) not in memo:
                memo[name, shape, dtype_] = converter.convert_meta(name, shape, dtype_)
            return memo[name, shape, dtype_]

        _MODELS[key] = (converter, converter.tensor_specs(), converted)
    return _MODELS[key]


class ScalePlanner:
    """Plans one sync of a model between two layouts, on metadata, with the project's planners."""

    @without_gc
    def __init__(self, family: str, hf_config: dict, trainer: TrainerLayout, fleet: FleetLayout, *,
                 dtype: str = "bfloat16", train_dtype: str = "bfloat16", draft: bool = True):
        self.trainer, self.fleet = trainer, fleet
        fleet.first_gpu(trainer)  # refuses colocated engines that do not fit on the trainer's GPUs
        started = time.perf_counter()
        self.converter, self.specs, converted = _model(family, hf_config, dtype, draft)
        self.units = stage_units(self.converter, trainer, dtype_from_name(train_dtype))
        outputs = {u.name: converted(u.name, u.full_shape, u.dtype) for us in self.units for u in us}
        self.unit_hf_bytes = {name: sum(m.nbytes for m in metas) for name, metas in outputs.items()}
        self.known_outputs = _KnownOutputs(outputs)
        self.stage_metas = [[m for u in units for m in outputs[u.name]] for units in self.units]
        self.converter.check_complete(m.name for metas in self.stage_metas for m in metas)
        self.engine = fleet.engine_layout(self.converter.config.get("num_key_value_heads") or 1)
        self.regions = RegionTable(self.engine, self.specs, fleet.engine_ranks)
        self._shards: tuple[list[int], list[int]] | None = None
        self._source_traffic: dict[int, Traffic] | None = None
        self.stage_bytes = [sum(m.nbytes for m in metas) for metas in self.stage_metas]
        self.setup_seconds = time.perf_counter() - started

    @without_gc
    def with_fleet(self, fleet: FleetLayout) -> "ScalePlanner":
        """Return this planner for another fleet of the same trainer (the trainer's side is reused)."""
        other = copy.copy(self)
        fleet.first_gpu(self.trainer)
        other.fleet = fleet
        other.engine = fleet.engine_layout(self.converter.config.get("num_key_value_heads") or 1)
        other.regions = RegionTable(other.engine, self.specs, fleet.engine_ranks)
        other._shards = None
        return other

    @property
    def model_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def draft_bytes(self) -> int:
        """Return the bytes of the draft (MTP) layers the engines hold (0 without them)."""
        main = self.converter.config["num_hidden_layers"]
        return sum(s.nbytes for s in self.specs if (m := HF_LAYER.match(s.name)) and int(m.group(1)) >= main)

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

    @without_gc
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

    # ---- broadcast (and ipc): one source per stage, every inference rank receives every bucket

    def _broadcast(self, bucket_bytes: int, transport: str = "broadcast") -> PlanSummary:
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
        receivers = [Endpoint(r, self.fleet.node_of(r, self.trainer), plan.total_bytes, len(self.specs),
                              len(plan.buckets), largest, len(senders)) for r in range(self.fleet.ranks)]
        shard, shard_tensors = self.shard_bytes()
        return PlanSummary(transport, self.trainer, self.fleet, self.model_bytes, len(self.specs), bucket_bytes,
                           senders, receivers, self._to_stage_sources(), shard, shard_tensors, stage_of,
                           {"buckets": len(plan.buckets), "max_bucket": plan.max_bucket_bytes})

    def _ipc(self, bucket_bytes: int) -> PlanSummary:
        why = ipc_refusal(self.trainer, self.fleet)
        if why:
            raise ValueError(f"transport ipc cannot run these layouts: {why}")
        return self._broadcast(bucket_bytes, "ipc")

    # ---- P2P: trainer ranks write straight into the head engines' GPUs, engines forward along chains

    def _p2p(self, bucket_bytes: int, window_bytes: int = 0, arena_bytes: int = 0, forward: bool = True) -> PlanSummary:
        options = P2POptions(bucket_bytes, window_bytes, arena_bytes, forward)
        totals = plan_p2p(self, options)
        senders, receivers = endpoints(self, totals, options)
        shard, shard_tensors = self.shard_bytes()
        extra = {"p2p": totals, "options": options, "egress": sum(totals.balance.load.values()),
                 "busiest_over_mean": totals.balance.busiest_over_mean()}
        return PlanSummary("p2p", self.trainer, self.fleet, self.model_bytes, len(self.specs), bucket_bytes,
                           senders, receivers, totals.gather, shard, shard_tensors, extra=extra)

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
                                    len(metas), chunks, max(sizes), self.fleet.ranks))
        read = sum(int(s.bytes * (len(steps.steps))) for s in senders)
        first = self.fleet.node_of(0, self.trainer)
        hosts = [Endpoint(n * self.fleet.gpus_per_node, first + n, read, len(self.specs),
                          sum(s.messages for s in senders) * len(steps.steps), max(s.largest for s in senders),
                          len(senders)) for n in range(self.fleet.nodes(self.trainer))]
        shard, shard_tensors = self.shard_bytes()
        return PlanSummary("disk_delta", self.trainer, self.fleet, self.model_bytes, len(self.specs),
                           options.chunk_bytes, senders, hosts, self._to_stage_sources(), shard, shard_tensors,
                           {s.rank: i for i, s in enumerate(senders)},
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


def ipc_refusal(trainer: TrainerLayout, fleet: FleetLayout) -> str:
    """Return why the built `transport: ipc` cannot run these layouts ('' when it can): it hands a stage
    source's buckets to the engine ranks of its own host, so both jobs must be colocated on one host."""
    if not fleet.colocated:
        return "the engines run on GPUs of their own (ipc needs the jobs colocated on the trainer's GPUs)"
    if trainer.nodes > 1:
        return (f"the trainer spans {trainer.nodes} nodes (ipc hands buckets over through one host's shared "
                "memory; use p2p or broadcast across hosts)")
    return ""


class _KnownOutputs:
    """`convert_meta` answered from the outputs the planner already computed (planners that take a
    converter ask it once more per unit)."""

    def __init__(self, outputs: dict[str, list[Any]]):
        self._outputs = outputs

    def convert_meta(self, name: str, shape: Any, dtype: Any) -> list[Any]:
        return self._outputs[name]


def _steady_chain(snapshot_every: int, behind: int):
    """Return what a reader `behind` versions behind applies, from `plan_chain` over a store whose
    versions 1..n carry a delta each and a snapshot every `snapshot_every`-th."""
    target = max(snapshot_every + behind, 2)
    published = {v: VersionInfo(v, f"s{v}", v == 1 or v % snapshot_every == 1, None if v == 1 else v - 1,
                                None if v == 1 else f"s{v - 1}") for v in range(1, target + 1)}
    held = Held(target - behind, f"s{target - behind}")
    return plan_chain(published, held, target)


__all__ = ["ScalePlanner", "PlanSummary", "Endpoint", "Traffic", "RegionTable", "TRANSPORTS", "ipc_refusal"]
