"""Inference side of a sync: receive buckets, verify, stage shards, agree, then load.

The engine only ever sees a complete, verified version: every transport rank
reports ok/error, and the commit (`engine.load_shards`) runs only if all are
ok. Any failure (a corrupt bucket, a sender error, a peer that died) leaves the
engine on its previous version and raises the same SyncAbortedError (or
PeerFailureError) on every surviving rank.

Copies: bucket k+1 arrives in one of two receive buffers while bucket k is
verified and this rank's regions of it (its engine's layout, `rank_layout()`)
are copied (once) into a staging set of the rank's params. There are two
staging sets (`megatron_sync.layout.staging`), allocated at start-up: a version
is staged into the set the engine is not running from, so the other set still
holds the live version's params. That set is the rollback source when a load
fails on another rank: a rollback costs one load, and no sync copies a
snapshot (only the first sync, before any set is live, asks the engine for
one). Memory: 2 receive buffers of the largest bucket + 2 x this rank's
params, held between syncs. With `staging_sets=1` (engines that copy) one set
and a host copy of the live version, taken between syncs, as rollback source.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from megatron_sync.plan.bucket import unpack
from megatron_sync.core.checksum import checksum, resolve_checksum
from megatron_sync.engines.base import EngineAdapter
from megatron_sync.core.errors import CorruptBucketError, PeerFailureError
from megatron_sync.layout.loaded import LoadCheck
from megatron_sync.layout.staging import StagingSets
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics, Timeline
from megatron_sync.plan.buckets import BucketPlan, KeepTogether
from megatron_sync.transports.buckets.plan_agreement import handshake_plan
from megatron_sync.transports.base import ABORTED_NBYTES, BucketHeader, BucketTransport, Commit, Receiver
from megatron_sync.session.commit import AgreedCommit


class WeightReceiver(Receiver):
    """Receives every sync into one engine rank over a bucket transport.

    Construction is collective: it runs the plan handshake with the stage
    sources (PlanMismatchError on every rank if plans, checksum choices or
    coverage disagree). `commit(staged_shards, version)` makes an agreed version
    live; it defaults to `engine.load_shards` (a serving loop passes its own,
    which applies the version at a generation step boundary). With `rollback`
    (default), if the load fails on another rank, this rank loads its previous
    shards back (from the other staging set, or from `engine.snapshot()` taken
    before the load when no set holds them yet), so no engine is left holding a
    mix of versions. The shards handed to `commit` stay untouched until two
    syncs later (an engine may keep them by reference).
    """

    def __init__(self, engine: EngineAdapter, transport: BucketTransport, *,
                 bucket_size_bytes: int, keep_together: KeepTogether = (),
                 metrics_path: Optional[str] = None, commit: Optional[Commit] = None,
                 rollback: bool = True, checksum: str = "auto", timeline: bool = False, verify_every: int = 1,
                 staging_sets: int = 2) -> None:
        self.engine, self.transport = engine, transport
        self.layout = engine.rank_layout()
        self.metrics_path = metrics_path
        self.record_timeline = timeline
        self.history: list[SyncMetrics] = []
        self.checksum = resolve_checksum(checksum, transport.device)
        self.plan = handshake_plan(transport, None, bucket_size_bytes, keep_together,
                                   expected=engine.expected_tensors(), checksum=self.checksum, layout=self.layout)
        self.staging = StagingSets(self.layout, transport.alloc, staging_sets, keep=rollback)
        self.check = LoadCheck(self.layout, engine, self.checksum, verify_every,
                               f"inference rank {transport.rank - transport.num_stages}")
        self._agreed = AgreedCommit.over(transport, engine, commit, rollback=rollback,
                                         live_shards=self.staging.live_params, check=self.check)
        # Two receive buffers: bucket k+1 arrives while bucket k is verified and staged (none when the
        # transport hands each bucket over where it already lies).
        self._buffers = [None if transport.delivers_in_place else transport.alloc(self.plan.max_bucket_bytes)
                         for _ in range(2)]

    @property
    def snapshots_taken(self) -> int:
        """How many `engine.snapshot()` copies were made (the first sync only, normally)."""
        return self._agreed.snapshots_taken

    @property
    def buffer_bytes(self) -> int:
        """Bytes this receiver holds between syncs in the transport's memory: receive buffers plus the staging
        sets (with one set, `staging.host_bytes` more on the host)."""
        return sum(b.numel() for b in self._buffers if b is not None) + self.staging.nbytes

    def live_shards(self, version: int) -> Optional[dict[str, torch.Tensor]]:
        """Return the staging set the engine runs on, when it runs `version` (else None)."""
        return self.staging.live_params(version)

    @property
    def commit(self) -> Commit:
        """What makes an agreed version live: `commit(staged shards, version)`."""
        return self._agreed.commit

    @commit.setter
    def commit(self, commit: Commit) -> None:
        self._agreed.commit = commit

    def receive(self, version: int) -> SyncMetrics:
        """Receive, verify and (if every rank agrees) load `version`; return its metrics."""
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank,
                              timeline=Timeline() if self.record_timeline else None,
                              shard_bytes=self.layout.shard_bytes, held_bytes=self.buffer_bytes)
        metrics.started_at = time.time()
        self.transport.take_media_bytes()  # what moved before this sync is not its own
        with PhaseTimer(metrics, "total"):
            staged = self.staging.begin()
            self.check.begin(version)
            error = self._receive_all(version, metrics)
            self._agreed(version, error, staged, metrics)
            self.staging.committed(version)
        metrics.media_bytes = self.transport.take_media_bytes()
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def live_set(self) -> Optional[tuple[int, torch.Tensor]]:
        """Return (version, flat bytes) of the staging set the engine runs on, or None when the engine does not
        run on a version this receiver committed (e.g. its start-up weights): what a fleet engine relays."""
        held = self.staging.live_buffer(self.engine.version)
        return None if held is None else (self.engine.version, held)

    def receive_relayed(self, version: int, fill: Callable[[torch.Tensor], None]) -> SyncMetrics:
        """Commit `version` received from another engine: `fill(target set bytes)` writes the whole staging
        set (raising when the bytes are not intact), then both agreement rounds run with the trainer as for a
        version received from it, so the engine's ranks commit it all or none."""
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank,
                              shard_bytes=self.layout.shard_bytes, held_bytes=self.buffer_bytes)
        metrics.started_at = time.time()
        with PhaseTimer(metrics, "total"):
            staged = self.staging.begin()
            self.check.skip()  # the relayed set was checked end to end against the relay's own checksum
            error = None
            try:
                with PhaseTimer(metrics, "transfer"):
                    fill(self.staging.buffer(self.staging.target))
                metrics.bytes = metrics.copied_bytes = self.staging.set_bytes
            except PeerFailureError as e:
                error = f"the relay broke off: {e}"
            except Exception as e:  # noqa: BLE001 — agreed on, then raised on every rank
                error = f"{type(e).__name__}: {e}"
            self._agreed(version, error, staged, metrics)
            self.staging.committed(version)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _receive_all(self, version: int, metrics: SyncMetrics) -> Optional[str]:
        """Receive every bucket (always all, to stay in lockstep); return the first error or None."""
        buckets = self.plan.buckets
        error: Optional[str] = None
        posted_at = time.perf_counter()
        pending = self.transport.recv_bucket(buckets[0], self._buffers[0]) if buckets else None
        for k, bucket in enumerate(buckets):
            wait_start = time.perf_counter()
            header, data = pending.wait()
            wait_end = time.perf_counter()
            metrics.add("transfer", wait_end - wait_start)
            metrics.event("wire", bucket.index, posted_at, pending.done_at or wait_end)
            if k + 1 < len(buckets):
                posted_at = time.perf_counter()
                pending = self.transport.recv_bucket(buckets[k + 1], self._buffers[(k + 1) % 2])
            metrics.bytes += bucket.nbytes
            metrics.num_buckets += 1
            if error is not None:
                continue
            try:
                with PhaseTimer(metrics, "checksum", ("verify", bucket.index)):
                    self._verify(version, bucket, header, data)
                with PhaseTimer(metrics, "apply", ("stage", bucket.index)):  # this rank's regions, one copy
                    metrics.copied_bytes += self._stage(bucket, data)
            except PeerFailureError:
                raise
            except Exception as e:  # noqa: BLE001 — agreed on, then raised on every rank
                error = f"{type(e).__name__}: {e}"
        return error

    def _verify(self, version: int, bucket: BucketPlan, header: BucketHeader, data: torch.Tensor) -> None:
        where = f"bucket {bucket.index} (stage {bucket.stage}, first tensor {bucket.entries[0].name!r})"
        if header.nbytes == ABORTED_NBYTES:
            raise RuntimeError(f"{where}: the stage {bucket.stage} sender aborted before sending it")
        if (header.version, header.index, header.nbytes) != (version, bucket.index, bucket.nbytes):
            raise CorruptBucketError(
                f"{where}: header says version {header.version} bucket {header.index} "
                f"{header.nbytes} bytes, expected version {version} bucket {bucket.index} {bucket.nbytes} bytes"
            )
        if self.checksum == "none":
            return
        got = checksum(data[: bucket.nbytes], self.checksum)
        if got != header.checksum:
            raise CorruptBucketError(
                f"{where}: {self.checksum} {got:#x} != sender's {header.checksum:#x}; bucket rejected"
            )

    def _stage(self, bucket: BucketPlan, data: torch.Tensor) -> int:
        """Copy this rank's regions of the bucket's tensors into the target staging set; return the bytes."""
        copied = 0
        for name, full in unpack(data, bucket).items():
            self.check.record_tensor(name, full)  # verified bytes: what the engine must hold once loaded
            copied += self.staging.write(name, full)
        return copied
