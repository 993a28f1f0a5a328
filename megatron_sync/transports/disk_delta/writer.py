"""The trainer-side writer: publish each version of the replica to the store, off the training path.

`submit(version, tensors)` copies one version of the inference-format replica
into a writer-owned buffer and returns; a background thread encodes it against
the last *published* version, publishes it atomically, and garbage-collects.
Training resumes as soon as the copy is taken.

When versions arrive faster than they are published, `when_behind` decides:

- "coalesce" (default): the newest waiting version is replaced by the new one,
  which is then encoded against the last published version. The replaced
  version is never published (it is listed in `skipped`), readers jump from
  the last published version to the newest one, and training never waits. In
  RL the engines want the freshest policy; an intermediate version that no
  engine will ever load is not worth a stall.
- "block": `submit` waits until the encoder takes a waiting version (bounded
  by `block_timeout_s`). Every version is published; training pays for it.

A reader that cannot reach a version (a damaged file, a broken chain) asks
for a snapshot (`storedir.request_snapshot`); the next version published
then carries one, so readers recover one version later instead of waiting
for the next scheduled snapshot.

An error while publishing a version (disk full, ...) leaves nothing of that
version visible and is raised, once, by the next `submit` or `flush`; the
writer keeps going and the next version is a delta against the last version
that was published.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Callable, Mapping, Optional

import numpy as np
import torch

import megatron_sync.transports.disk_delta.storedir as storedir
from megatron_sync.transports.disk_delta.errors import DeltaError, StoreWriteError, WriterClosedError
from megatron_sync.transports.disk_delta.fsio import FileLock
from megatron_sync.transports.disk_delta.options import WriterOptions
from megatron_sync.transports.disk_delta.publish import Base, PublishStats, TensorLayout, write_version

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    version: int
    layout: TensorLayout
    buffer: np.ndarray


class DeltaWriter:
    """Publishes versions of `{hf_name: tensor}` under `root`, each encoded against the previous one.

    One writer per root (a file lock). A new writer removes what a dead one left
    unpublished and starts with a full snapshot; versions must keep increasing.
    """

    def __init__(self, root: str, options: Optional[WriterOptions] = None, *,
                 on_published: Optional[Callable[[PublishStats], None]] = None):
        """`on_published(stats)` runs on the writer thread after each version is visible (for example to
        tell the engines); an exception it raises is reported like a failed publish."""
        self.root, self.options, self._on_published = root, options or WriterOptions(), on_published
        os.makedirs(root, exist_ok=True)
        self._lock = FileLock(os.path.join(root, storedir.WRITER_LOCK), "the delta store's writer",
                              "run one writer per store directory (the trainer's first rank)"
                              ).acquire(wait_s=storedir.WRITER_LOCK_WAIT_S)
        storedir.remove_leftovers(root)
        self._cache = storedir.ManifestCache(root)
        existing = storedir.published_versions(root)
        self._last_version = existing[-1] if existing else 0
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._free: list[np.ndarray] = []
        self._base: Optional[Base] = None
        self._since_snapshot = 0
        self._busy, self._closing = False, False
        self._error: Optional[BaseException] = None
        self.stats: list[PublishStats] = []
        self.skipped: list[int] = []  # versions replaced by a newer one before they were published
        # A pool that lives as long as the writer keeps each thread's scratch buffers warm.
        self._executor = (concurrent.futures.ThreadPoolExecutor(self.options.encode_threads, "delta-encode")
                          if self.options.encode_threads > 1 else None)
        self._thread = threading.Thread(target=self._run, name="delta-writer", daemon=True)
        self._thread.start()

    @property
    def published_version(self) -> Optional[int]:
        """Return the last version this writer published (None before the first)."""
        with self._cond:
            return self._base.manifest.version if self._base else None

    def submit(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` (one version of the replica) and queue them for publishing as `version`.

        Returns once the copy is taken. Raises, once, the error of an earlier version's
        publish (that version is not published; this one is not queued).
        """
        layout = TensorLayout.of(tensors)
        buffer = self.reserve(layout)
        try:
            layout.fill(buffer, tensors)
        except BaseException:
            self.release(buffer)
            raise
        self.submit_buffer(version, layout, buffer)

    def reserve(self, layout: TensorLayout) -> np.ndarray:
        """Return a writer-owned buffer for one version laid out by `layout`.

        The caller fills it (for example straight from the weight stream, with no copy of
        its own) and hands it back with `submit_buffer`, or with `release` when filling failed.
        """
        with self._cond:
            if self._closing:
                raise WriterClosedError(f"the delta writer of {self.root} is closed; create a new one")
            return self._take_buffer_locked(layout.nbytes)

    def release(self, buffer: np.ndarray) -> None:
        """Give back a reserved buffer that will not be submitted."""
        with self._cond:
            self._free.append(buffer)

    def submit_buffer(self, version: int, layout: TensorLayout, buffer: np.ndarray) -> None:
        """Queue a filled buffer from `reserve` for publishing as `version` (the writer owns it again).

        Raises, once, the error of an earlier version's publish (then this version is not queued).
        """
        with self._cond:
            try:
                self._raise_error_locked()
                if version <= self._last_version:
                    raise ValueError(f"version {version} must be greater than {self._last_version}, the last one "
                                     "submitted or already in the store; versions only increase")
                if len(self._queue) >= self.options.queue_depth:
                    self._make_room_locked()
            except BaseException:
                self._free.append(buffer)
                raise
            self._queue.append(_Job(version, layout, buffer))
            self._last_version = version
            self._cond.notify_all()

    @property
    def last_version(self) -> int:
        """Return the newest version submitted, or already in the store when this writer started (0: none)."""
        with self._cond:
            return self._last_version

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every submitted version is published or skipped; raise a pending publish error."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue and not self._busy, timeout):
                raise TimeoutError(f"the delta writer did not publish its queue within {timeout}s")
            self._raise_error_locked()

    def close(self, timeout: Optional[float] = None) -> None:
        """Publish what is queued, stop the thread, release the store; raise a pending publish error."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the delta writer did not finish within {timeout}s")
        if self._executor is not None:
            self._executor.shutdown()
        self._lock.release()
        with self._cond:
            self._raise_error_locked(closing=True)

    def __enter__(self) -> "DeltaWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- submit side (holding self._cond)

    def _raise_error_locked(self, closing: bool = False) -> None:
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, DeltaError):
                raise error
            raise StoreWriteError(f"publishing a version failed: {error!r}") from error
        if self._closing and not closing:
            raise WriterClosedError(f"the delta writer of {self.root} is closed; create a new one")

    def _make_room_locked(self) -> None:
        if self.options.when_behind == "coalesce":
            job = self._queue.pop()
            self.skipped.append(job.version)
            self._free.append(job.buffer)
            return
        if not self._cond.wait_for(lambda: len(self._queue) < self.options.queue_depth,
                                   self.options.block_timeout_s):
            raise TimeoutError(f"submit waited {self.options.block_timeout_s:g}s for the delta writer "
                               "(when_behind='block'); raise block_timeout_s or use when_behind='coalesce'")

    def _take_buffer_locked(self, nbytes: int) -> np.ndarray:
        self._free = [b for b in self._free if b.nbytes == nbytes]  # a new layout frees the old buffers
        return self._free.pop() if self._free else np.empty(nbytes, dtype=np.uint8)

    # -- background thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()
            try:
                stats = self._publish(job)
            except BaseException as exc:  # noqa: BLE001 — reported by the next submit/flush/close
                with self._cond:  # first: a submit that follows the failed record must raise it
                    self._error = exc
                    self._free.append(job.buffer)
                self.record_failure(job.version, exc)
            else:
                self._after_publish(stats)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _publish(self, job: _Job) -> PublishStats:
        base = self._base if self._base is not None and self._base.layout == job.layout else None
        requests = storedir.snapshot_requests(self.root)
        snapshot = base is None or self._since_snapshot + 1 >= self.options.snapshot_every or bool(requests)
        manifest, stats = write_version(self.root, job.version, job.layout, job.buffer, base=base,
                                        snapshot=snapshot, options=self.options, executor=self._executor)
        if requests:
            log.warning("delta store %s: version %d carries a snapshot that readers asked for: %s", self.root,
                        job.version, "; ".join(f"{r.reader} could not reach version {r.version} ({r.reason})"
                                               for r in requests))
            storedir.clear_snapshot_requests(self.root, requests)
        with self._cond:
            if self._base is not None:
                self._free.append(self._base.data)
            self._base = Base(manifest, job.layout, job.buffer)
            self._since_snapshot = 0 if snapshot else self._since_snapshot + 1
            self.stats.append(stats)
        return stats

    def record_failure(self, version: int, exc: BaseException) -> None:
        """Tell the readers that `version` will not be published (its publish failed, or it was never
        submitted), so they stop waiting for it."""
        try:
            storedir.mark_failed(self.root, version, f"{type(exc).__name__}: {exc}")
        except (OSError, DeltaError) as e:  # the disk may be too full even for that: readers wait out timeout_s
            log.warning("delta store %s: could not record that version %d failed (%s)", self.root, version, e)

    def _after_publish(self, stats: PublishStats) -> None:
        try:
            if self._on_published is not None:
                self._on_published(stats)
        except BaseException as exc:  # noqa: BLE001 — the version is published; the caller hears of it
            with self._cond:
                self._error = exc
        try:
            storedir.clear_failed(self.root, below=stats.version)
            storedir.collect_garbage(self.root, self.options.retention, self.options.lease_ttl_s, self._cache)
        except OSError as exc:  # the version is published; a failed clean-up must not fail training
            log.warning("delta store %s: garbage collection failed (%s); old versions stay on disk", self.root, exc)
