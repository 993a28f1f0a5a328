"""The trainer half of a P2P sync on one trainer rank: walk, stage, write, agree.

Every trainer rank joins. Per version it walks its stage's units with the schedule's gatherer (gathering
only what its group sends), converts the units it sends pieces of, and hands each converted tensor to its
`ShareWriter`, which stages the pieces in the rank's registered arena and writes them into the receivers'
windows; then it takes part in both agreement rounds. The arena is allocated and registered once, on the
device the weights are produced on, and reused by every version.
"""

from __future__ import annotations


import logging
import time
from typing import TYPE_CHECKING, Iterator, Mapping, Optional

import torch

from megatron_sync.core.grid import TrainerRank
from megatron_sync.core.agreement import describe
from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PeerFailureError
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.session.commit import sender_rounds
from megatron_sync.transports.base import Sender
from megatron_sync.transports.p2p.endpoint import P2PEndpoint
from megatron_sync.transports.p2p.handshake import TrainerSide, handshake
from megatron_sync.transports.p2p.holders import SourceUnit, source_units
from megatron_sync.transports.p2p.notices import Notices, PostedBases, engine_boards
from megatron_sync.transports.p2p.schedule import ROUND_PIECES, Schedule, ScheduleOptions
from megatron_sync.transports.p2p.walk import ScheduledGatherer
from megatron_sync.transports.p2p.writer import ShareWriter

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.trainer.stream import MegatronWeightStream

log = logging.getLogger("megatron_sync")
MiB = 2**20


def schedule_options(config: "WeightSyncConfig") -> ScheduleOptions:
    """Return the schedule's sizes from the trainer's settings."""
    window = int(config.p2p_window_mb * MiB)
    return ScheduleOptions(piece_bytes=config.bucket_size_bytes, window_bytes=window,
                           round_bytes=ROUND_PIECES * config.bucket_size_bytes,
                           arena_bytes=int(config.p2p_arena_mb * MiB), forward=config.p2p_forward,
                           staging_sets=config.staging_sets)


class P2PSender(Sender):
    """One trainer rank's P2P sender (transport rank == its rank in the trainer job)."""

    def __init__(self, transport: P2PEndpoint, stream: "MegatronWeightStream", schedule: Schedule,
                 units: list[SourceUnit], config: "WeightSyncConfig") -> None:
        self.transport, self.stream, self.schedule = transport, stream, schedule
        mover, rank = transport.mover, transport.rank
        self.checksum = resolve_checksum(config.checksum, mover.device)
        self.arena = mover.alloc(max(schedule.arena_bytes(rank), 1))
        self.writer = ShareWriter(schedule, rank, mover, self.arena, algorithm=self.checksum,
                                  timeout_s=config.timeout_s)
        self.gatherer = ScheduledGatherer(stream.layout, TrainerRank.of(stream.layout, rank),
                                          {u.name: u for u in units}, schedule.balance.gathering,
                                          schedule.unit_senders(),
                                          # half the budget gathers, the other half lets gathers run ahead in
                                          # the stream's prefetch thread while this one converts and writes
                                          budget_bytes=max(1, stream.gather_budget_bytes // 2),
                                          tracker=stream.tracker, handoff=True)
        self.expected = [m for u in stream.units() if u.name in self.gatherer.sends
                         for m in stream.converter.convert_meta(u.name, u.full_shape, u.dtype)]
        self.metrics_path = config.metrics_path
        self.history: list[SyncMetrics] = []
        self.keep_sent = False  # checks and dumps: keep the full tensors this rank sent pieces of
        self._sent: dict[str, torch.Tensor] = {}
        self._pulled = 0.0  # seconds the last walk kept this thread waiting
        self._attempt = 0  # syncs so far; trainer and engines count them in step
        self._target = 0  # the staging set every receiver takes the next version into
        # group rank 0 hosts the notice stores, one per engine; the other ranks read their ports at first use
        self._notice_board = engine_boards(transport.group, schedule.receivers)

    @classmethod
    def connect(cls, transport: P2PEndpoint, stream: "MegatronWeightStream",
                config: "WeightSyncConfig") -> "P2PSender":
        """Return the sender after the start-up handshake (collective over the transport)."""
        layout, rank = stream.layout, transport.rank
        units = source_units(stream.units(), stream.converter, layout)
        first = rank == 0
        side = TrainerSide(TrainerRank.of(layout, rank), units if layout.is_stage_source else None,
                           stream.converter.tensor_specs() if first else None,
                           schedule_options(config) if first else None)
        schedule = handshake(transport, num_trainer_ranks=transport.num_trainer_ranks,
                             engine_tp_size=config.engine_tp_size, trainer=lambda: side)
        if first:
            log.info("[trainer rank 0] P2P schedule: %d pieces, trainer egress %d bytes, busiest sender %.3f x the "
                     "mean, bytes per rank %s", len(schedule.pieces), schedule.trainer_egress(),
                     schedule.balance.busiest_over_mean(), schedule.bytes_from_sender())
        return cls(transport, stream, schedule, units, config)

    def sent_tensors(self) -> Optional[dict[str, torch.Tensor]]:
        """Return the full tensors this rank sent pieces of in its last sync, when `keep_sent` was set."""
        return dict(self._sent) if self.keep_sent else None

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The walk's tensors; `self._pulled` adds up the time this thread waited for them (converting, and
        waiting for the prefetch thread's gathers)."""
        self._sent, self._pulled = {}, 0.0
        walk = self.stream.walk(self.gatherer, self.expected)
        while True:
            start = time.perf_counter()
            item = next(walk, None)
            self._pulled += time.perf_counter() - start
            if item is None:
                return
            name, full = item
            if self.keep_sent:
                self._sent[name] = full.clone()
            yield name, full

    def replay_last(self) -> int:
        """Write this rank's messages of the last version again, the wire alone (`ShareWriter.replay`; for
        benchmarks: the raw transport of the same bytes), into the staging set the next version overwrites;
        return the bytes. Every trainer rank calls it at once, between syncs."""
        if self.schedule.options.staging_sets == 1:
            raise ValueError("replay writes into the staging set the next version overwrites; with staging_sets 1 "
                             "that is the live version's own set: benchmark the raw writes with staging_sets 2")
        return self.writer.replay(self._offsets(None))

    def _offsets(self, notices: Optional[Notices]) -> Mapping[int, int]:
        """Return where each receiver's target set starts in its window: after `_target` sets (both sides flip
        sets at every version all ranks committed), or with one set as each receiver posts it."""
        if self.schedule.options.posts_base and notices is not None:
            return PostedBases(notices, self.writer.timeout_s)
        return {i: self._target * r.layout.nbytes for i, r in enumerate(self.schedule.receivers)}

    def _flip(self) -> None:
        """Every rank committed a version (or the receivers took it from another engine): they flipped sets."""
        self._target = (self._target + 1) % self.schedule.options.staging_sets

    def agree_only(self, version: int) -> None:
        """Take part in `version`'s agreement rounds without writing (an engine fed by another engine: a
        fleet's chain); keeps the attempt and staging-set counters in step with the receivers."""
        self._attempt += 1
        sender_rounds(self.transport, version, None)
        self._flip()

    def sync(self, version: int) -> SyncMetrics:
        """Walk, stage and write this rank's pieces of `version`, then agree; raise on failure."""
        rank = self.transport.rank
        self._attempt += 1
        notices = Notices(self.transport.group.control_board(), version, self._attempt, shards=self._notice_board)
        metrics = SyncMetrics(version, role="sender", rank=rank)
        metrics.started_at = time.time()
        with PhaseTimer(metrics, "total"):
            error = None
            offsets = self._offsets(notices)
            with PhaseTimer(metrics, "transfer"):
                try:
                    stats = self.writer.write_version(self._tensors(), notices, offsets)
                    metrics.bytes, metrics.num_buckets = stats.nbytes, len(self.schedule.sender_messages(rank))
                    metrics.add("checksum", stats.checksum_seconds)
                    metrics.add("pack", stats.stage_seconds)
                except PeerFailureError:
                    raise  # a receiver is gone: the transport must be rebuilt
                except Exception as e:  # noqa: BLE001 — its receivers have the error; agreed on below
                    error = f"trainer rank {rank}: {describe(e, limit=3)}"
            # gather: busy time in the prefetch thread, overlapping the rest; transfer: what writing took
            # besides staging, checksums and waiting for the walk (converting, or a gather not yet done)
            metrics.add("gather", self.stream.phase_seconds.get("gather", 0.0))
            metrics.add("convert", self.stream.phase_seconds.get("convert", 0.0))
            metrics.phases["transfer"] -= sum(metrics.phases.get(p, 0.0) for p in ("checksum", "pack")) + self._pulled
            with PhaseTimer(metrics, "commit"):
                sender_rounds(self.transport, version, error)
            self._flip()
        metrics.ended_at = time.time()
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics
