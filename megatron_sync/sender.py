"""Trainer side of a sync: walk the HF stream, pack the host replica, send buckets, commit.

Double buffering: a bucket is sent (asynchronously) as soon as its last
tensor is packed, and the stream keeps producing the next bucket while the
broadcast runs; the sender only waits for bucket k when bucket k+1 is ready
to go (or at the end). Stages send in stage order; a stage source also takes
part in the other stages' broadcasts (that is what a broadcast is), issuing the
earlier stages' receives up front so they too overlap its own production.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from megatron_sync.agreement import describe
from megatron_sync.errors import SyncError
from megatron_sync.metrics import PhaseTimer, SyncMetrics
from megatron_sync.plan import BucketPlan, KeepTogether, SyncPlan, handshake_plan
from megatron_sync.replica import HostReplica
from megatron_sync.stream import HFWeightStream
from megatron_sync.transport.base import ABORTED_NBYTES, BucketHeader, BucketTransport, Sender, Waitable
from megatron_sync.transport.commit import sender_rounds

BucketHook = Callable[[int, torch.Tensor], None]


class WeightSender(Sender):
    """Sends one pipeline stage's weights each sync; every trainer rank owns one.

    On a stage source, `transport` and `plan` are required. On other trainer
    ranks they are None and `sync` only drives the stream (its gathers are
    collectives the source needs).
    """

    def __init__(self, stream: HFWeightStream, transport: Optional[BucketTransport], plan: Optional[SyncPlan],
                 metrics_path: Optional[str] = None, *, after_checksum: Optional[BucketHook] = None) -> None:
        self.stream, self.transport, self.plan = stream, transport, plan
        self.metrics_path = metrics_path
        self.history: list[SyncMetrics] = []
        # Test hook: called with (bucket index, bucket bytes) after the checksum is taken.
        self._after_checksum = after_checksum
        self.replica: Optional[HostReplica] = None
        if stream.is_source:
            if transport is None or plan is None:
                raise ValueError(f"stage {stream.stage}'s source rank needs a transport and a plan")
            assert transport.rank == stream.stage, (transport.rank, stream.stage)
            self.replica = HostReplica(plan, stream.stage)

    @classmethod
    def connect(cls, stream: HFWeightStream, transport: Optional[BucketTransport], *, bucket_size_bytes: int,
                keep_together: KeepTogether = (), **kwargs) -> "WeightSender":
        """Return a sender after the start-up plan handshake (sources only; collective on the group)."""
        plan = None
        if stream.is_source:
            plan = handshake_plan(transport, stream.metadata(), bucket_size_bytes, keep_together)
        return cls(stream, transport, plan, **kwargs)

    def sync(self, version: int) -> SyncMetrics:
        """Send `version` and return its metrics once every rank committed it.

        Raises SyncAbortedError (same failures on every rank) or PeerFailureError.
        """
        metrics = SyncMetrics(version, role="sender", rank=self.transport.rank if self.transport else -1)
        with PhaseTimer(metrics, "total"):
            if self.replica is None:
                with PhaseTimer(metrics, "gather"):
                    for _ in self.stream:
                        pass
            else:
                self._sync_source(version, metrics)
            _split_convert_time(self.stream, metrics)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _sync_source(self, version: int, metrics: SyncMetrics) -> None:
        stage = self.stream.stage
        scratch = self.transport.alloc(self.plan.max_bucket_bytes)
        earlier = [self.transport.recv_bucket(b, scratch) for b in self.plan.buckets if b.stage < stage]
        error = None
        try:
            self._send_own_stage(version, metrics)
        except SyncError:
            raise
        except Exception as e:  # noqa: BLE001 — agreed failure: tell every rank instead of leaving them waiting
            error = f"stage {stage} sender: {describe(e, limit=3)}"
            self._send_aborted(version)
        with PhaseTimer(metrics, "transfer"):
            for pending in earlier:
                pending.wait()
            for b in self.plan.buckets:
                if b.stage > stage:
                    self.transport.recv_bucket(b, scratch).wait()
        with PhaseTimer(metrics, "commit"):
            sender_rounds(self.transport, version, error)

    def _send_own_stage(self, version: int, metrics: SyncMetrics) -> None:
        own = self.replica.buckets
        self.replica.begin(version)
        self._sent = 0  # own buckets issued so far (read by _send_aborted)
        in_flight: Optional[_InFlight] = None
        items = iter(self.stream)
        try:
            while True:
                with PhaseTimer(metrics, "gather"):
                    item = next(items, None)
                if in_flight is not None:
                    in_flight.poll()
                if item is None:
                    break
                with PhaseTimer(metrics, "pack"):
                    self.replica.pack(*item)
                while self._sent < len(own) and self.replica.is_complete(own[self._sent].index):
                    if in_flight is not None:
                        self._finish(in_flight, metrics)
                    in_flight = self._issue(version, own[self._sent], metrics)
                    self._sent += 1
        except BaseException:
            _drain(items)
            raise
        finally:
            if in_flight is not None:
                self._finish(in_flight, metrics)
        missing = self.replica.missing()
        if missing:
            raise ValueError(
                f"stage {self.stream.stage}'s stream ended without yielding {missing[:20]} "
                "that its metadata() listed"
            )
        self.replica.finish()

    def _issue(self, version: int, bucket: BucketPlan, metrics: SyncMetrics) -> "_InFlight":
        with PhaseTimer(metrics, "pack"):
            crc = self.replica.checksum(bucket.index)
            data = self.replica.data(bucket.index)
            if self._after_checksum is not None:
                self._after_checksum(bucket.index, data)
        header = BucketHeader(version, bucket.index, bucket.nbytes, crc)
        metrics.bytes += bucket.nbytes
        metrics.num_buckets += 1
        with PhaseTimer(metrics, "transfer"):  # issuing the (asynchronous) broadcasts
            return _InFlight(self.transport.send_bucket(header, bucket, data))

    def _finish(self, in_flight: "_InFlight", metrics: SyncMetrics) -> None:
        wait_start = time.perf_counter()
        in_flight.pending.wait()
        metrics.add("transfer", time.perf_counter() - wait_start)
        metrics.overlap_s += min(wait_start, in_flight.done_at or wait_start) - in_flight.issued_at

    def _send_aborted(self, version: int) -> None:
        """Send this stage's unsent buckets with an ABORTED header so receivers stay in lockstep."""
        for bucket in self.replica.buckets[self._sent:]:
            header = BucketHeader(version, bucket.index, ABORTED_NBYTES, 0)
            self.transport.send_bucket(header, bucket, self.replica.data(bucket.index)).wait()


def _split_convert_time(stream: HFWeightStream, metrics: SyncMetrics) -> None:
    """Move the stream's own conversion time out of "gather", where pulling the stream counted it."""
    seconds = stream.phase_seconds.get("convert", 0.0)
    metrics.phases["convert"] += seconds
    metrics.phases["gather"] = max(0.0, metrics.phases["gather"] - seconds)


def _drain(items) -> None:
    """Finish walking the stream after a failure: the stage's other ranks are in its gathers too."""
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 — the first error is the one being raised
        pass


class _InFlight:
    """A sent bucket and when it was issued / first seen complete (for the overlap metric)."""

    def __init__(self, pending: Waitable) -> None:
        self.pending = pending
        self.issued_at = time.perf_counter()
        self.done_at: Optional[float] = None

    def poll(self) -> None:
        if self.done_at is None and self.pending.is_completed():
            self.done_at = time.perf_counter()
