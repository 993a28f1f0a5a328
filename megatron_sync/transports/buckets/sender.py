"""Trainer side of a sync: walk the HF stream into the host replica, send buckets, commit.

Pipeline on a stage source (three things run at once):

- the stream's gather thread gathers unit k+1 (within the gather budget);
- this thread converts unit k straight into its slot in its bucket
  (`HostReplica.slot`: no separate pack copy) and, when a bucket is complete,
  issues its broadcast, then checksums it *while it is on the wire* (the
  header with the checksum follows the payload);
- the transport moves up to `max_in_flight` buckets; the sender waits for the
  oldest only when one more would exceed that.

On the NCCL path buckets are produced and broadcast in device memory; the host
replica is filled from them on a side stream (see `replica.py`). Stages send
in stage order; a stage source also takes part in the other stages'
broadcasts, issuing the earlier stages' receives up front so they too overlap
its own production.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.checksum import checksum, resolve_checksum
from megatron_sync.core.errors import SyncError
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics, Timeline
from megatron_sync.plan.buckets import BucketPlan, KeepTogether, SyncPlan
from megatron_sync.transports.buckets.plan_agreement import handshake_plan
from megatron_sync.trainer.replica import HostReplica
from megatron_sync.trainer.stream import HFWeightStream
from megatron_sync.transports.base import ABORTED_NBYTES, BucketHeader, BucketTransport, Sender, Waitable
from megatron_sync.session.commit import sender_rounds

WireHook = Callable[[int, torch.Tensor], Optional[torch.Tensor]]


class WeightSender(Sender):
    """Sends one pipeline stage's weights each sync; every trainer rank owns one.

    On a stage source, `transport` and `plan` are required. On other trainer
    ranks they are None and `sync` only drives the stream (its gathers are
    collectives the source needs). `checksum` is a `weight_sync.checksum`
    choice ("auto" resolves by where the transport keeps bucket bytes);
    `timeline=True` records per-bucket events in each sync's metrics.
    """

    def __init__(self, stream: HFWeightStream, transport: Optional[BucketTransport], plan: Optional[SyncPlan],
                 metrics_path: Optional[str] = None, *, checksum: str = "auto", timeline: bool = False,
                 max_in_flight: int = 2, corrupt_wire: Optional[WireHook] = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.stream, self.transport, self.plan = stream, transport, plan
        self.metrics_path = metrics_path
        self.history: list[SyncMetrics] = []
        self.record_timeline = timeline
        self.max_in_flight = min(max_in_flight, transport.max_buckets_in_flight) if transport else max_in_flight
        # Test hook: returns other bytes to put on the wire for (bucket index, bucket bytes); the
        # checksum still covers the bucket's own bytes, as if the wire had corrupted them.
        self._corrupt_wire = corrupt_wire
        self.replica: Optional[HostReplica] = None
        self._replica_version: Optional[int] = None  # the version the replica holds in full
        self._sealed: dict[int, int] = {}  # bucket index -> checksum of the replica's version (for resends)
        self.checksum = "none"
        if stream.is_source:
            if transport is None or plan is None:
                raise ValueError(f"stage {stream.stage}'s source rank needs a transport and a plan")
            assert transport.rank == stream.stage, (transport.rank, stream.stage)
            self.checksum = resolve_checksum(checksum, transport.device)
            device = transport.device if transport.device.type == "cuda" else None
            self.replica = HostReplica(plan, stream.stage, device=device)

    @classmethod
    def connect(cls, stream: HFWeightStream, transport: Optional[BucketTransport], *, bucket_size_bytes: int,
                keep_together: KeepTogether = (), checksum: str = "auto", **kwargs) -> "WeightSender":
        """Return a sender after the start-up plan handshake (sources only; collective on the group)."""
        plan = None
        if stream.is_source:
            plan = handshake_plan(transport, stream.metadata(), bucket_size_bytes, keep_together,
                                  checksum=resolve_checksum(checksum, transport.device))
        return cls(stream, transport, plan, checksum=checksum, **kwargs)

    def sent_tensors(self) -> dict[str, torch.Tensor]:
        """Return views of the host replica by HF name (empty on a rank that is not a stage source)."""
        if self.replica is None:
            return {}
        return {e.name: self.replica.view(e.name) for b in self.replica.buckets for e in b.entries}

    def resend(self, version: int) -> SyncMetrics:
        """Send `version` again from the replica, without walking the stream (stage sources only): what a
        fleet's later wave gets from the trainer. The replica must hold `version` (the last `sync`)."""
        assert self.replica is not None, "only a stage source resends"
        if self._replica_version != version:
            raise ValueError(f"the host replica holds version {self._replica_version}, not {version}; a resend "
                             "repeats the last version synced")
        metrics = SyncMetrics(version, role="sender", rank=self.transport.rank)
        with PhaseTimer(metrics, "total"):
            self._sync_source(version, metrics, produce=False)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def sync(self, version: int) -> SyncMetrics:
        """Send `version` and return its metrics once every rank committed it.

        Raises SyncAbortedError (same failures on every rank) or PeerFailureError.
        """
        metrics = SyncMetrics(version, role="sender", rank=self.transport.rank if self.transport else -1,
                              timeline=Timeline() if self.record_timeline else None)
        self._pulled = 0.0  # time this thread spent waiting for the stream (gather + convert, or a fake's work)
        if self.transport is not None:
            self.transport.take_media_bytes()  # what moved before this sync is not its own
        with PhaseTimer(metrics, "total"):
            if self.replica is None:
                for _ in self._pull(self.stream.walk(record=metrics.event)):
                    pass
            else:
                self._sync_source(version, metrics)
            # Busy time inside the stream (gather runs in the stream's own thread); a stream that does
            # not report it is charged the time spent pulling it.
            reported = self.stream.phase_seconds
            metrics.add("convert", reported.get("convert", 0.0))
            metrics.add("gather", reported.get("gather", max(0.0, self._pulled - reported.get("convert", 0.0))))
        if self.transport is not None:
            metrics.media_bytes = self.transport.take_media_bytes()
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _pull(self, items):
        """Yield from the stream's `items`, adding the time spent waiting for each to `self._pulled`."""
        iterator = iter(items)
        try:
            while True:
                start = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self._pulled += time.perf_counter() - start
                yield item
        finally:
            close = getattr(iterator, "close", None)  # a generator: closing it finishes the stream's gathers
            if close is not None:
                close()

    def _sync_source(self, version: int, metrics: SyncMetrics, *, produce: bool = True) -> None:
        stage = self.stream.stage
        others = [b for b in self.plan.buckets if b.stage != stage]
        scratch = [self.transport.alloc(self.plan.max_bucket_bytes) for _ in range(2)] if others else []
        # Earlier stages' buckets go out first; this rank takes part in their broadcasts (in a tree it
        # forwards them) from a thread while this thread already produces its own buckets.
        self._earlier = _Relay(self.transport, [b for b in others if b.stage < stage], scratch)
        error = None
        try:
            if produce:
                self._send_own_stage(version, metrics)
            else:
                self._resend_own_stage(version, metrics)
        except SyncError:
            raise
        except Exception as e:  # noqa: BLE001 — agreed failure: tell every rank instead of leaving them waiting
            error = f"stage {stage} sender: {describe(e, limit=3)}"
            self._earlier.join()
            self._send_aborted(version)
        finally:
            self._earlier.join()
        with PhaseTimer(metrics, "transfer"):
            _Relay(self.transport, [b for b in others if b.stage > stage], scratch).join()
        with PhaseTimer(metrics, "commit", ("commit", -1)):
            sender_rounds(self.transport, version, error)

    def _send_own_stage(self, version: int, metrics: SyncMetrics) -> None:
        own = self.replica.buckets
        self._replica_version = None  # until the whole version is in it
        self._sealed.clear()
        self.replica.begin(version)
        self._sent = 0  # own buckets issued so far (read by _send_aborted)
        self._seal_error: Optional[str] = None
        in_flight: collections.deque[_InFlight] = collections.deque()
        items = self._pull(self.stream.walk(into=self.replica.slot, record=metrics.event))

        def issue_ready() -> None:
            # Own broadcasts follow the earlier stages' on the group, so they start once those are done.
            while (self._sent < len(own) and self.replica.is_complete(own[self._sent].index)
                   and self._earlier.done()):
                if len(in_flight) >= self.max_in_flight:
                    self._finish(in_flight.popleft(), metrics)
                in_flight.append(self._issue(version, own[self._sent], metrics))
                self._sent += 1

        try:
            for name, tensor in items:
                with PhaseTimer(metrics, "pack"):  # nothing to copy when it was converted into its slot
                    self.replica.pack(name, tensor)
                for sent in in_flight:
                    sent.poll()
                issue_ready()
            with PhaseTimer(metrics, "transfer"):
                self._earlier.join()
            issue_ready()
        except Exception:  # the stage's other ranks are in its gathers: walk them to the end
            _drain(items)
            raise  # (a stop signal is not drained: every rank of the job got it and is leaving)
        finally:
            while in_flight:
                self._finish(in_flight.popleft(), metrics)
        if self._seal_error is not None:
            raise RuntimeError(self._seal_error)
        missing = self.replica.missing()
        if missing:
            raise ValueError(
                f"stage {self.stream.stage}'s stream ended without yielding {missing[:20]} "
                "that its metadata() listed"
            )
        self.replica.finish()
        self._replica_version = version

    def _resend_own_stage(self, version: int, metrics: SyncMetrics) -> None:
        """Send every own bucket from the replica's host bytes (checksums as computed when it was filled)."""
        self._sent = 0
        self._seal_error = None
        in_flight: collections.deque[_InFlight] = collections.deque()
        with PhaseTimer(metrics, "transfer"):
            self._earlier.join()
        try:
            for bucket in self.replica.buckets:
                if len(in_flight) >= self.max_in_flight:
                    self._finish(in_flight.popleft(), metrics)
                in_flight.append(self._issue(version, bucket, metrics, payload=self.replica.data(bucket.index)))
                self._sent += 1
        finally:
            while in_flight:
                self._finish(in_flight.popleft(), metrics)

    def _issue(self, version: int, bucket: BucketPlan, metrics: SyncMetrics,
               payload: Optional[torch.Tensor] = None) -> "_InFlight":
        """Start the bucket's broadcast; its checksum is computed while the payload travels (a resend of
        the replica's `payload` reuses the checksum computed when it was filled)."""
        resend = payload is not None
        if not resend:
            self.replica.fill_host(bucket.index)  # device buckets: host copy on a side stream
            payload = self.replica.payload(bucket.index)
        wire = payload
        if self._corrupt_wire is not None:
            wire = self._corrupt_wire(bucket.index, payload)
            wire = payload if wire is None else wire
        sealed = [0.0]

        def seal() -> BucketHeader:
            if resend and bucket.index in self._sealed:
                return BucketHeader(version, bucket.index, bucket.nbytes, self._sealed[bucket.index])
            with PhaseTimer(metrics, "checksum", ("checksum", bucket.index)) as timer:
                try:
                    value = checksum(payload, self.checksum)
                    self._sealed[bucket.index] = value
                except Exception as e:  # noqa: BLE001 — receivers drop the bucket; the sync fails everywhere
                    self._seal_error = self._seal_error or f"checksum of bucket {bucket.index}: {describe(e, limit=3)}"
                    return BucketHeader(version, bucket.index, ABORTED_NBYTES, 0)
            sealed[0] = timer.elapsed
            return BucketHeader(version, bucket.index, bucket.nbytes, value)

        metrics.bytes += bucket.nbytes
        metrics.num_buckets += 1
        issued_at = time.perf_counter()
        pending = self.transport.send_bucket(bucket, wire, seal)
        metrics.add("transfer", time.perf_counter() - issued_at - sealed[0])  # posting the broadcasts
        return _InFlight(bucket.index, pending, issued_at)

    def _finish(self, in_flight: "_InFlight", metrics: SyncMetrics) -> None:
        wait_start = time.perf_counter()
        in_flight.pending.wait()
        wait_end = time.perf_counter()
        metrics.add("transfer", wait_end - wait_start)
        in_flight.poll()
        done_at = in_flight.done_at or wait_end
        metrics.overlap_s += min(wait_start, done_at) - in_flight.issued_at
        metrics.event("wire", in_flight.index, in_flight.issued_at, done_at)
        self.replica.release(in_flight.index)

    def _send_aborted(self, version: int) -> None:
        """Send this stage's unsent buckets with an ABORTED header so receivers stay in lockstep."""
        for bucket in self.replica.buckets[self._sent:]:
            header = BucketHeader(version, bucket.index, ABORTED_NBYTES, 0)
            self.transport.send_bucket(bucket, self.replica.payload(bucket.index), lambda h=header: h).wait()


def _drain(items) -> None:
    """Finish walking the stream after a failure: the stage's other ranks are in its gathers too."""
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 — the first error is the one being raised
        pass


class _Relay:
    """Takes part in other stages' bucket broadcasts, in order, in a background thread.

    Each receive has its own buffer until it completes (two, alternating): in a
    tree broadcast this rank forwards what it receives, so a buffer must not be
    reused while a broadcast still reads from it.
    """

    def __init__(self, transport: BucketTransport, buckets: list[BucketPlan], buffers: list[torch.Tensor]) -> None:
        self._transport, self._buckets, self._buffers = transport, buckets, buffers
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if buckets:
            self._thread = threading.Thread(target=self._run, name="megatron-sync-relay", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            previous = None
            for k, bucket in enumerate(self._buckets):
                current = self._transport.recv_bucket(bucket, self._buffers[k % 2])
                if previous is not None:
                    previous.wait()
                previous = current
            if previous is not None:
                previous.wait()
        except BaseException as e:  # noqa: BLE001 — raised by join()
            self._error = e

    def done(self) -> bool:
        """True once every receive completed (or failed; `join` raises then)."""
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        """Wait for every receive; raise the first error (a dead peer)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class _InFlight:
    """A sent bucket, when it was issued and when it was first seen complete (overlap, timeline)."""

    def __init__(self, index: int, pending: Waitable, issued_at: float) -> None:
        self.index, self.pending, self.issued_at = index, pending, issued_at
        self.done_at: Optional[float] = None

    def poll(self) -> None:
        if self.done_at is None and self.pending.is_completed():
            self.done_at = self.pending.done_at or time.perf_counter()
