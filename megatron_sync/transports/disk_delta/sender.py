"""The trainer half of a disk-delta sync: walk the stream into the writer's buffer, hand it over, return.

On a stage source the HF stream is converted straight into a buffer the
stage's `DeltaWriter` owns (no replica of its own, no extra copy); the writer's
thread encodes it against the last published version and publishes it while
training goes on. `sync(v)` therefore returns the metrics of the *submission*
(gather, convert, pack); each version's publication is reported later, when
it becomes visible, as a row with role "publisher" (in `published` and in
`metrics_path`). A publish that failed is raised by the next `sync` on every
trainer rank (the driver's agreement), or logged by `close`; a version that
could not even be handed over is recorded as failed in the store, like one
whose publish failed, so no engine waits for it.

Other trainer ranks only walk the stream (its gathers are collectives the
stage source needs).
"""

from __future__ import annotations

import threading
from typing import Optional

from megatron_sync.transports.disk_delta.publish import PublishStats, TensorLayout
from megatron_sync.transports.disk_delta.writer import DeltaWriter
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.trainer.stream import HFWeightStream
from megatron_sync.transports.base import Sender


class DeltaSender(Sender):
    """Submits each version of one stage to its writer (stage sources) or drives the stream (other ranks)."""

    def __init__(self, stream: HFWeightStream, writer: Optional[DeltaWriter], *, version_offset: int,
                 rank: int = -1, metrics_path: Optional[str] = None) -> None:
        if stream.is_source and writer is None:
            raise ValueError(f"stage {stream.stage}'s source rank needs a delta writer")
        self.stream, self.writer, self.rank = stream, writer, rank
        self.version_offset, self.metrics_path = version_offset, metrics_path
        self.layout = (TensorLayout.of_specs((m.name, m.dtype, m.shape) for m in stream.metadata())
                       if writer is not None else None)
        self.history: list[SyncMetrics] = []  # one row per sync(): the submission
        self.published: list[SyncMetrics] = []  # one row per published version (appended by the writer thread)
        self.publish_stats: list[PublishStats] = []  # sizes and encodings of each published version
        self._lock = threading.Lock()

    def sync(self, version: int) -> SyncMetrics:
        """Hand `version` to the writer and return the submission's metrics (it is published later)."""
        metrics = SyncMetrics(version, role="sender", rank=self.rank)
        with PhaseTimer(metrics, "total"):
            if self.writer is None:
                for _ in self.stream:
                    pass
            else:
                self._submit(version, metrics)
        for phase in ("gather", "convert"):
            metrics.phases[phase] = self.stream.phase_seconds.get(phase, 0.0)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _submit(self, version: int, metrics: SyncMetrics) -> None:
        """Walk the stream into a writer buffer and queue it; a version that cannot be queued (the walk
        failed, or the writer raises an earlier publish's failure) is recorded as failed in the store, so
        the engines waiting for it abort at once."""
        try:
            self._fill_and_queue(version, metrics)
        except BaseException as e:
            self.writer.record_failure(self.version_offset + version, e)
            raise

    def _fill_and_queue(self, version: int, metrics: SyncMetrics) -> None:
        layout, entries = self.layout, {e.name: e for e in self.layout.entries}
        buffer = self.writer.reserve(layout)
        missing, error = set(entries), None
        try:
            for name, tensor in self.stream:  # walked to the end even after an error: the stage's other
                if error is not None:        # ranks are in its gathers
                    continue
                try:
                    with PhaseTimer(metrics, "pack"):
                        if name not in missing:
                            raise ValueError(f"tensor {name!r} is not in stage {self.stream.stage}'s metadata, "
                                             f"or was yielded twice for version {version}")
                        layout.fill_one(buffer, entries[name], tensor)
                        missing.discard(name)
                except Exception as e:  # noqa: BLE001 — raised once the walk is complete
                    error = e
            if error is not None:
                raise error
            if missing:
                raise ValueError(f"stage {self.stream.stage}'s stream ended without yielding {sorted(missing)[:20]} "
                                 "that its metadata() listed")
        except BaseException:
            self.writer.release(buffer)
            raise
        metrics.bytes += layout.nbytes
        with PhaseTimer(metrics, "commit"):  # waits only with when_behind="block" and a full queue
            self.writer.submit_buffer(self.version_offset + version, layout, buffer)

    def on_published(self, stats: PublishStats) -> None:
        """Record one published version (called on the writer's thread)."""
        row = SyncMetrics(stats.version - self.version_offset, role="publisher", rank=self.rank)
        row.phases["transfer"] = row.phases["total"] = stats.seconds  # encode + write + publish
        row.bytes = stats.delta_bytes + stats.snapshot_bytes
        with self._lock:
            self.published.append(row)
            self.publish_stats.append(stats)
            row.append_to(self.metrics_path)

