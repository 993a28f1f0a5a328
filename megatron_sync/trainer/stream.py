"""The one public stream of inference-format weights that every transport consumes."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_sync.core.agreement import failing_together, torch_gather
from megatron_sync.settings.config import DEFAULT_GATHER_BUDGET_MB
from megatron_sync.trainer.gather import GatherMemoryTracker, GatherUnit, ShardGatherer, plan_gather_units
from megatron_sync.core.meta import TensorMeta
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.source import walk_model_chunks

Into = Callable[[str], Optional[torch.Tensor]]
"""`into(hf_name)`: where to convert a tensor (its slot in a bucket), or None for a fresh tensor."""
Record = Callable[[str, int, float, float], None]
"""`record(phase, item, start, end)`: a timeline event (see `metrics.Timeline`)."""


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

    def walk(self, *, into: Optional[Into] = None, record: Optional[Record] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Iterate as `__iter__` does, converting into `into(hf_name)` where it offers a destination
        (the yielded tensor is then that destination) and reporting timeline events to `record`."""


DEFAULT_GATHER_BUDGET_BYTES = int(DEFAULT_GATHER_BUDGET_MB * 2**20)


class MegatronWeightStream:
    """HF-format tensors gathered and converted from this rank's Megatron model chunks.

    Construction is collective over `group` (default: the whole trainer job):
    every rank plans its gather units and the source converts the metadata;
    an unmapped name or a shape that contradicts the HF config fails on every
    rank at once, before any data moves.

    Pipelining: on the source rank the gathers run in a background thread
    (`prefetch`, default on) while the caller's thread converts, so gathering
    unit k+1 overlaps converting unit k (and whatever the caller does with it,
    e.g. a broadcast of the previous bucket). The gather budget still bounds
    memory: the gatherer batches within half of it, and the thread starts the
    next gather only while the gathered-but-unconverted tensors take at most
    the other half, so gathered bytes alive stay within budget + largest tensor.
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
        prefetch: bool = True,
    ):
        if gather_budget_bytes <= 0:
            raise ValueError(f"gather_budget_bytes must be positive, got {gather_budget_bytes}")
        self._chunks = chunks
        self.group = group  # the trainer job's group the stream's start-up checks run on (None: the default)
        self.layout = layout
        self.converter = converter
        self.tracker = tracker or GatherMemoryTracker()
        self.gather_budget_bytes = gather_budget_bytes
        # Every rank of the stage batches its gathers alike (they are collectives), so the halved
        # budget applies everywhere; only the source, which converts, runs the gather thread.
        budget = max(1, gather_budget_bytes // 2) if prefetch else gather_budget_bytes
        self.prefetch = prefetch and layout.is_stage_source
        self._gatherer = ShardGatherer(layout, budget_bytes=budget, tracker=self.tracker, handoff=self.prefetch)
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

    def _narrowed_units(self) -> list[GatherUnit]:
        """Return `units()`, each in the narrowest dtype that converts to the same bits (what this
        stream's own gatherer moves)."""
        return [dataclasses.replace(u, dtype=self.converter.gather_dtype(u.name, u.dtype)) for u in self.units()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.walk()

    def walk(self, gatherer: Any = None, expected: Optional[list[TensorMeta]] = None, *,
             into: Optional[Into] = None, record: Optional[Record] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) for each unit `gatherer` hands this rank whole, converted and
        checked against `expected` (what this rank yields, in order).

        Iterating the stream is `walk()`: its own gatherer and `metadata()`, units whole on the
        stage source, gathered in a background thread there (see the class doc). A transport that
        keeps its replica elsewhere (P2P: each rank converts its assigned units) walks with its own
        gatherer (`gather(units)` yielding `(unit, full tensor or None)`), in a prefetch thread too when
        the gatherer hands its tensors off (`handoff`: held until `release(unit, full)`), else in this thread.
        `into(hf_name)` offers a destination to convert into (the yielded tensor is then that
        destination); `record` receives timeline events. Collective over the stage; a conversion
        error is raised once the walk is complete, so the stage's other ranks are never left in a gather.
        """
        own = gatherer is None
        gatherer = self._gatherer if own else gatherer
        expected = self._meta if expected is None else expected
        units = self._narrowed_units() if own else self.units()
        if [u.name for u in units] != self._unit_names:
            raise RuntimeError(
                "the model's parameters changed since the weight stream was planned; "
                "rebuild the weight sync after changing the model"
            )
        expected_iter = iter(expected)
        self._phase_seconds = seconds = {"gather": 0.0, "convert": 0.0}
        gathered = _timed(gatherer.gather(units), seconds, record)
        if (own and self.prefetch) or getattr(gatherer, "handoff", False):  # gathers run ahead, in a thread
            gathered = _Prefetcher(gathered, gatherer, self.gather_budget_bytes - gatherer.budget_bytes)
        failure: Exception | None = None
        try:
            for index, (unit, full) in enumerate(gathered):
                try:
                    if full is None or failure is not None:
                        continue  # after a local failure keep gathering: the stage's other ranks are in the collectives
                    try:
                        converted = self._convert(index, unit, full, into, seconds, record, expected_iter)
                    except Exception as exc:  # noqa: BLE001 — raised once the walk is complete
                        failure = exc
                        continue
                    yield from converted  # the outputs may share the gathered tensor's memory
                finally:
                    _done(gathered, unit, full)
        finally:
            if isinstance(gathered, _Prefetcher):
                gathered.close()
        if failure is not None:
            raise failure

    def _convert(self, index: int, unit: Any, full: torch.Tensor, into: Optional[Into], seconds: dict[str, float],
                 record: Optional[Record], expected: Iterator[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        """Convert gathered unit `index` (timed as "convert") and check each output against the plan."""
        start = time.perf_counter()
        converted = (self.converter.convert(unit.name, full) if into is None
                     else self.converter.convert(unit.name, full, into=into))
        end = time.perf_counter()
        seconds["convert"] += end - start
        if record is not None:
            record("convert", index, start, end)
        for hf_name, tensor in converted:
            _check_against_plan(next(expected, None), hf_name, tensor, unit.name)
        return converted


def _timed(gathered: Iterator, seconds: dict[str, float], record: Optional[Record]) -> Iterator:
    """Yield what `gathered` yields, adding the time spent producing each item to seconds["gather"]."""
    index = 0
    while True:
        start = time.perf_counter()
        item = next(gathered, None)
        end = time.perf_counter()
        seconds["gather"] += end - start
        if item is None:
            return
        if record is not None:
            record("gather", index, start, end)
        index += 1
        yield item


def _done(gathered: Any, unit: GatherUnit, full: Optional[torch.Tensor]) -> None:
    """Tell a prefetcher the consumer is done with this gathered tensor (its bytes stop counting)."""
    if isinstance(gathered, _Prefetcher):
        gathered.release(unit, full)


class _Prefetcher:
    """Runs a gather generator in a background thread, ahead of the consumer within a memory bound.

    The gatherer runs in handoff mode: a yielded tensor counts in its tracker
    until `release` (the consumer converted it). The thread starts each further
    gather only while the tracker counts at most `ahead_bytes` (or the consumer
    holds nothing), and one gather adds at most the gatherer's own budget plus
    the largest tensor. Errors in the thread (a dead peer) surface in the consumer.
    """

    def __init__(self, gathered: Iterator, gatherer: Any, ahead_bytes: int) -> None:
        self._gathered, self._gatherer, self._ahead = gathered, gatherer, ahead_bytes
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._outstanding = 0  # items handed over and not yet released
        self._finished = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="megatron-sync-gather", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tracker = self._gatherer.tracker
        try:
            for unit, full in self._gathered:
                with self._cond:
                    self._outstanding += 1
                    self._queue.append((unit, full))
                    self._cond.notify_all()
                    while tracker.live > self._ahead and self._outstanding > 0:
                        self._cond.wait()
        except BaseException as e:  # noqa: BLE001 — handed to the consumer
            self._error = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def __iter__(self) -> "_Prefetcher":
        return self

    def __next__(self) -> tuple[GatherUnit, Optional[torch.Tensor]]:
        with self._cond:
            while not self._queue and not self._finished:
                self._cond.wait()
            if self._queue:
                return self._queue.popleft()
        if self._error is not None:
            raise self._error
        raise StopIteration

    def release(self, unit: GatherUnit, full: Optional[torch.Tensor]) -> None:
        """The consumer is done with (unit, full): its bytes stop counting and the thread may go on."""
        self._gatherer.release(unit, full)
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Finish the walk (the stage's other ranks are in its gathers too), releasing what is left."""
        for unit, full in self._drain():
            self.release(unit, full)
        self._thread.join()

    def _drain(self) -> Iterator:
        try:
            yield from self
        except BaseException:  # noqa: BLE001 — the consumer is already raising the first error
            return


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
