"""Inference side of a sync: receive buckets, verify, stage shards, agree, then load.

The engine only ever sees a complete, verified version: shards are staged as
copies (never views into the reused receive buffers), every transport rank
reports ok/error, and `engine.load_shards` runs only if all are ok. Any failure
(a corrupt bucket, a sender error, a peer that died) leaves the engine on its
previous version and raises the same SyncAbortedError (or PeerFailureError) on
every surviving rank.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from megatron_sync.bucket import checksum, unpack
from megatron_sync.engines.base import EngineAdapter
from megatron_sync.errors import CorruptBucketError, PeerFailureError
from megatron_sync.metrics import PhaseTimer, SyncMetrics
from megatron_sync.plan import BucketPlan, KeepTogether, handshake_plan
from megatron_sync.transport.base import ABORTED_NBYTES, BucketHeader, BucketTransport, Commit, Receiver
from megatron_sync.transport.commit import AgreedCommit


class WeightReceiver(Receiver):
    """Receives every sync into one engine rank over a bucket transport.

    Construction is collective: it runs the plan handshake with the stage
    sources (PlanMismatchError on every rank if plans or coverage disagree).
    `commit(staged_shards, version)` makes an agreed version live; it defaults
    to `engine.load_shards` (a serving loop passes its own, which applies the
    version at a generation step boundary). With `rollback` (default) the live
    shards are copied (`engine.snapshot()`) before each load; if the load then
    fails on another rank, this rank loads the copy back, so no engine is left
    holding a mix of versions (the price is one extra copy of this rank's
    shards during the load).
    """

    def __init__(self, engine: EngineAdapter, transport: BucketTransport, *,
                 bucket_size_bytes: int, keep_together: KeepTogether = (),
                 metrics_path: Optional[str] = None, commit: Optional[Commit] = None,
                 rollback: bool = True) -> None:
        self.engine, self.transport = engine, transport
        self._agreed = AgreedCommit(transport, engine, commit, rollback=rollback)
        self.metrics_path = metrics_path
        self.history: list[SyncMetrics] = []
        self.plan = handshake_plan(transport, None, bucket_size_bytes, keep_together,
                                   expected=engine.expected_tensors())
        # Two receive buffers: bucket k+1 arrives while bucket k is verified and staged.
        self._buffers = [transport.alloc(self.plan.max_bucket_bytes) for _ in range(2)]

    @property
    def commit(self) -> Commit:
        """What makes an agreed version live: `commit(staged shards, version)`."""
        return self._agreed.commit

    @commit.setter
    def commit(self, commit: Commit) -> None:
        self._agreed.commit = commit

    def receive(self, version: int) -> SyncMetrics:
        """Receive, verify and (if every rank agrees) load `version`; return its metrics."""
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank)
        with PhaseTimer(metrics, "total"):
            staging: dict[str, torch.Tensor] = {}
            try:
                error = self._receive_all(version, staging, metrics)
                self._agreed(version, error, staging, metrics)
            finally:
                staging.clear()  # on failure: drop the new version; the engine keeps the old one
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _receive_all(self, version: int, staging: dict[str, torch.Tensor],
                     metrics: SyncMetrics) -> Optional[str]:
        """Receive every bucket (always all, to stay in lockstep); return the first error or None."""
        buckets = self.plan.buckets
        error: Optional[str] = None
        pending = self.transport.recv_bucket(buckets[0], self._buffers[0]) if buckets else None
        for k, bucket in enumerate(buckets):
            wait_start = time.perf_counter()
            header, data = pending.wait()
            metrics.add("transfer", time.perf_counter() - wait_start)
            if k + 1 < len(buckets):
                pending = self.transport.recv_bucket(buckets[k + 1], self._buffers[(k + 1) % 2])
            metrics.bytes += bucket.nbytes
            metrics.num_buckets += 1
            if error is not None:
                continue
            try:
                with PhaseTimer(metrics, "apply"):  # checksum verification + staging this rank's slices
                    self._verify(version, bucket, header, data)
                    self._stage(bucket, data, staging)
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
        got = checksum(data)
        if got != header.checksum:
            raise CorruptBucketError(
                f"{where}: crc32 {got:#010x} != sender's {header.checksum:#010x}; bucket rejected"
            )

    def _stage(self, bucket: BucketPlan, data: torch.Tensor, staging: dict[str, torch.Tensor]) -> None:
        for name, full in unpack(data, bucket).items():
            # clone: the receive buffer is reused by the next bucket
            staging[name] = self.engine.shard_of(name, full).clone(memory_format=torch.contiguous_format)
