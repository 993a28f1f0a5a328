"""The one public stream of inference-format weights that every transport consumes."""

from __future__ import annotations

import time
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_sync.agreement import failing_together, torch_gather
from megatron_sync.config import DEFAULT_GATHER_BUDGET_MB
from megatron_sync.gather import GatherMemoryTracker, GatherUnit, ShardGatherer, plan_gather_units
from megatron_sync.meta import TensorMeta
from megatron_sync.parallel import ParallelLayout
from megatron_sync.source import walk_model_chunks


@runtime_checkable
class HFWeightStream(Protocol):
    """HF-format tensors of one pipeline stage, produced by gathering and converting.

    Iterating is collective: every trainer rank of the stage iterates it in
    lockstep (the gathers are collectives), and only the stage's source rank
    receives tensors. `metadata()` lists, on the source rank, exactly what
    iteration yields, in the same order, without moving any data.
    """

    @property
    def is_source(self) -> bool:
        """True on the rank that yields this stage's tensors (the stage's first rank)."""

    @property
    def stage(self) -> int:
        """The pipeline stage (PP rank) this stream belongs to."""

    def metadata(self) -> list[TensorMeta]:
        """Return the stage's HF tensors in yield order (empty on non-source ranks)."""

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds the last walk spent per phase inside the stream ("gather", "convert")."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) on the source rank; participate in gathers elsewhere."""


DEFAULT_GATHER_BUDGET_BYTES = int(DEFAULT_GATHER_BUDGET_MB * 2**20)


class MegatronWeightStream:
    """HF-format tensors gathered and converted from this rank's Megatron model chunks.

    Construction is collective over `group` (default: the whole trainer job):
    every rank plans its gather units and the source converts the metadata;
    an unmapped name or a shape that contradicts the HF config fails on every
    rank at once, before any data moves.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        layout: ParallelLayout,
        converter: Any,
        *,
        gather_budget_bytes: int = DEFAULT_GATHER_BUDGET_BYTES,
        tracker: GatherMemoryTracker | None = None,
        group: Any = None,
    ):
        if gather_budget_bytes <= 0:
            raise ValueError(f"gather_budget_bytes must be positive, got {gather_budget_bytes}")
        self._chunks = chunks
        self.group = group  # the trainer job's group the stream's start-up checks run on (None: the default)
        self.layout = layout
        self.converter = converter
        self.tracker = tracker or GatherMemoryTracker()
        self._gatherer = ShardGatherer(layout, budget_bytes=gather_budget_bytes, tracker=self.tracker)
        self._meta: list[TensorMeta] = []
        self._phase_seconds = {"gather": 0.0, "convert": 0.0}  # of the last walk
        with failing_together("planning the weight stream (names, shapes, conversion rules)", torch_gather(group)):
            units = self.units()
            self._unit_names = [u.name for u in units]
            if self.is_source:
                self._meta = [m for u in units for m in converter.convert_meta(u.name, u.full_shape, u.dtype)]

    @property
    def is_source(self) -> bool:
        return self.layout.is_stage_source

    @property
    def stage(self) -> int:
        return self.layout.pp_rank

    def metadata(self) -> list[TensorMeta]:
        return list(self._meta)

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self._phase_seconds

    def units(self) -> list[GatherUnit]:
        """Return this rank's gather units (its local shards with global names), in walk order."""
        tensors = walk_model_chunks(self._chunks, self.layout, is_buffer=self.converter.is_buffer)
        return [u for u in plan_gather_units(tensors, self.layout) if not self.converter.is_skipped(u.name)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.walk(self._gatherer, self._meta)

    def walk(self, gatherer: Any, expected: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) for each unit `gatherer` hands this rank whole, converted and
        checked against `expected` (what this rank yields, in order).

        Iterating the stream is `walk(its gatherer, metadata())`: units whole on the stage
        source. A transport that keeps its replica elsewhere (P2P: each rank converts its
        assigned units) walks with its own gatherer (`gather(units)` yielding `(unit, full
        tensor or None)`). Collective over the stage; a conversion error is raised once
        the walk is complete, so the stage's other ranks are never left in a gather.
        """
        units = self.units()
        if [u.name for u in units] != self._unit_names:
            raise RuntimeError(
                "the model's parameters changed since the weight stream was planned; "
                "rebuild the weight sync after changing the model"
            )
        expected_iter = iter(expected)
        self._phase_seconds = seconds = {"gather": 0.0, "convert": 0.0}
        gathered = gatherer.gather(units)
        failure: Exception | None = None
        while True:
            start = time.perf_counter()
            item = next(gathered, None)
            seconds["gather"] += time.perf_counter() - start
            if item is None:
                break
            unit, full = item
            if full is None or failure is not None:
                continue  # after a local failure keep gathering: the stage's other ranks are in the collectives
            try:
                start = time.perf_counter()
                converted = self.converter.convert(unit.name, full)
                seconds["convert"] += time.perf_counter() - start
                for hf_name, tensor in converted:
                    _check_against_plan(next(expected_iter, None), hf_name, tensor, unit.name)
            except Exception as exc:  # noqa: BLE001 — raised once the walk is complete
                failure = exc
                continue
            yield from converted
        if failure is not None:
            raise failure


def _check_against_plan(meta: TensorMeta | None, name: str, tensor: torch.Tensor, source: str) -> None:
    if meta is None or (meta.name, meta.shape, meta.dtype) != (name, tuple(tensor.shape), tensor.dtype):
        raise RuntimeError(
            f"converting {source} produced {name} {tuple(tensor.shape)} {tensor.dtype}, "
            f"but the metadata announced {meta}; the converter's convert() and convert_meta() disagree"
        )


def all_stage_metadata(stream: MegatronWeightStream) -> list[list[TensorMeta]]:
    """Return every pipeline stage's metadata on every stage source (collective over PP sources).

    Call it on stage sources only; the PP group of the first rank joins exactly
    the stage sources.
    """
    layout = stream.layout
    if layout.pp == 1:
        return [stream.metadata()]
    per_stage: list[Any] = [None] * layout.pp
    dist.all_gather_object(per_stage, [m.to_wire() for m in stream.metadata()], group=layout.pp_group)
    return [[TensorMeta.from_wire(w) for w in stage] for stage in per_stage]


def check_model_complete(stage_metadata: list[list[TensorMeta]], converter: Any) -> None:
    """Raise unless the stages together produce exactly the HF checkpoint the converter expects."""
    produced = [m for stage in stage_metadata for m in stage]
    converter.check_complete(m.name for m in produced)
    expected = converter.expected_hf_tensors()
    for m in produced:
        shape, dtype = expected[m.name]
        if tuple(shape) != m.shape or dtype != m.dtype:
            raise ValueError(
                f"{m.name} would be sent as {m.shape} {m.dtype}, but the HF config implies "
                f"{tuple(shape)} {dtype}; fix the HF config or the model sizes so they agree"
            )
