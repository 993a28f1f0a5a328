"""The inference half of a disk-delta sync: patch the host's local copy, agree, load, agree, commit.

One rank per host applies (the first inference rank whose host name and
local directory match; it holds the host's applier lock): it runs one
`DeltaReader` per trainer stage. A sync of version v goes in three agreement
rounds over every inference rank:

1. target: the appliers wait until every stage's store holds a version >= v
   (the trainer publishes off its critical path, and coalesces versions when
   it runs ahead, so "v" means "the newest published, at least v"); the
   smallest newest version any applier sees is the target. If every rank
   already holds it, the sync is a no-op.
2. staged: each applier decodes the chain into its uncommitted slot and
   verifies every digest; the other ranks of its host learn the slot files.
   Nothing has touched the engine yet: this runs while it keeps generating.
3. loaded: every rank hands its params, cut from the staged tensors through its
   engine's layout (views into the memory-mapped slot where a param is one
   region: `load_shards` copies them), to `commit`, which pauses
   generation only for the load. Only when every rank loaded do the appliers
   commit their local copies. A rank that loaded while another failed rolls
   back to its snapshot, so no engine serves a mix of versions.

An engine that keeps references to the shards instead of copying them stays
correct while the local copy commits: they point into the committed slot,
and the next version is staged into the other one.

Any failure (a damaged file, a gap the store cannot bridge, a version not
published in time) is agreed on and raised as SyncAbortedError on every
inference rank; the engines keep the version they hold, and the reader has
asked the writer for a snapshot, so the next version heals the chain.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from typing import Any, Callable, Optional

import torch

from megatron_sync.core.agreement import agree, describe, failures_of
from megatron_sync.transports.disk_delta.localcopy import read_slot
from megatron_sync.transports.disk_delta.reader import DeltaReader, StagedVersion
from megatron_sync.core.wait import clock, poll
from megatron_sync.transports.disk_delta.storedir import failed_versions, published_versions, trainer_gone
from megatron_sync.engines.base import EngineAdapter
from megatron_sync.core.errors import SyncAbortedError
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.transports.base import Commit, Receiver
from megatron_sync.session.commit import AgreedCommit
from megatron_sync.session.files import LIVENESS_EVERY_S

log = logging.getLogger("megatron_sync")
Gather = Callable[[Any], list]


def host_key(local_dir: str) -> str:
    """Return what identifies one host's local copy: host name and the local directory's real path."""
    return f"{socket.gethostname()}:{os.path.realpath(local_dir)}"


def reader_id(local_dir: str) -> str:
    """Return this host's reader id in the stores' leases (host name + a digest of the local directory)."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host}-{hashlib.sha1(os.path.realpath(local_dir).encode()).hexdigest()[:8]}"


class DeltaReceiver(Receiver):
    """Applies published versions on one inference rank (construction is collective over inference ranks).

    `gather` is the all-gather over the inference ranks, in which this rank is `index`; `rank` names
    it in metrics. `stores[s]` is stage s's store; the host's copy of it lives in `local_dir/stage-<s>`.
    """

    def __init__(self, engine: EngineAdapter, *, stores: list[str], local_dir: str, gather: Gather, index: int,
                 rank: int, version_offset: int, timeout_s: float, commit: Optional[Commit] = None,
                 metrics_path: Optional[str] = None, rollback: bool = True) -> None:
        self.engine, self.stores, self.gather, self.index, self.rank = engine, stores, gather, index, rank
        self.layout = engine.rank_layout()
        self.version_offset, self.timeout_s = version_offset, timeout_s
        self._agreed = AgreedCommit(self._gather_agreed, index, engine, commit, rollback=rollback)
        self.metrics_path = metrics_path
        self.history: list[SyncMetrics] = []
        hosts = gather(host_key(local_dir))
        self.applier = hosts.index(hosts[index])  # the first inference rank of this host applies
        self.readers: list[DeltaReader] = []
        error = None
        if self.applier == index:
            try:
                for stage, store in enumerate(stores):
                    self.readers.append(DeltaReader(store, os.path.join(local_dir, f"stage-{stage}"),
                                                    reader_id=reader_id(local_dir)))
            except Exception as e:  # noqa: BLE001 — agreed on below, then raised on every rank
                self.close()
                error = describe(e, limit=2)
        agree(error, what="opening the inference hosts' local copies", gather=gather)

    def receive(self, version: int) -> SyncMetrics:
        """Apply the newest published version >= `version` (store numbering adds the session's offset)."""
        metrics = SyncMetrics(version, role="receiver", rank=self.rank)
        with PhaseTimer(metrics, "total"):
            target = self._choose_target(version, metrics)
            if target is not None:
                self._apply(version, target, metrics)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def close(self) -> None:
        """Release the host's applier lock and local files."""
        for reader in self.readers:
            reader.close()
        self.readers = []

    def _gather_agreed(self, version: int, error: Optional[str], **data: Any) -> list[dict[str, Any]]:
        """Gather this rank's `error` and `data`; raise SyncAbortedError on every rank if any rank failed."""
        replies = self.gather({"error": error, **data})
        failures = failures_of([r["error"] for r in replies])
        if failures:
            raise SyncAbortedError(version, failures)
        return replies

    # -- round 1: which version

    def _choose_target(self, version: int, metrics: SyncMetrics) -> Optional[int]:
        """Return the store version every rank will apply, or None when every rank already holds it."""
        newest, error = None, None
        with PhaseTimer(metrics, "transfer"):  # waiting for the trainer to publish (every rank waits here)
            if self.readers:
                try:
                    newest = self._wait_published(self.version_offset + version)
                except Exception as e:  # noqa: BLE001 — agreed on below
                    error = describe(e, limit=2)
            replies = self._gather_agreed(version, error, newest=newest, held=self.engine.version)
        target = min(r["newest"] for r in replies if r["newest"] is not None)
        return None if min(r["held"] for r in replies) >= target else target

    def _wait_published(self, wanted: int) -> int:
        """Return the newest version >= `wanted` that every stage's store holds, waiting up to `timeout_s`;
        raise at once when a stage's writer recorded that it could not publish it (a full disk, a version it
        could not take), and within about `LIVENESS_EVERY_S` when a stage's writer is gone (the trainer
        exited or died: nothing more will be published)."""
        looked = [clock().now()]

        def newest_published() -> Optional[int]:
            ready = self._published_from(wanted)
            if ready is not None:
                return ready
            failed = [f"{store}: version {v}: {error}" for store in self.stores
                      for v, error in failed_versions(store).items() if v >= wanted]
            if failed:
                raise RuntimeError(f"version {wanted} will not be published: the trainer's writer failed ("
                                   + "; ".join(failed) + ")")
            if clock().now() - looked[0] > LIVENESS_EVERY_S:
                looked[0] = clock().now()
                gone = trainer_gone(self.stores)
                if gone is not None:  # a writer publishes before it lets go: one more look settles it
                    ready = self._published_from(wanted)
                    if ready is None:
                        raise RuntimeError(f"version {wanted} will not be published: {gone}")
                    return ready
            return None

        def behind(_: float) -> TimeoutError:
            common = set.intersection(*(set(published_versions(store)) for store in self.stores))
            return TimeoutError(
                f"version {wanted} was not published in {self.stores} within timeout_s={self.timeout_s:g}s "
                f"(published there: {sorted(common)[-3:] or 'none'}): the trainer's writer is behind (raise "
                "timeout_s or delta_encode_threads) or failed (see the trainer's log)")

        return poll(newest_published, within=self.timeout_s, what=f"version {wanted} being published", timeout=behind)

    def _published_from(self, wanted: int) -> Optional[int]:
        """Return the newest version >= `wanted` every stage's store holds (None: none yet)."""
        common = set.intersection(*(set(published_versions(store)) for store in self.stores))
        return max((v for v in common if v >= wanted), default=None)

    # -- rounds 2 and 3: stage, load, commit

    def _apply(self, version: int, target: int, metrics: SyncMetrics) -> None:
        staged: list[Optional[StagedVersion]] = []
        try:
            files, error = self._stage(target, staged, metrics)
            with PhaseTimer(metrics, "commit"):
                replies = self._gather_agreed(version, error, files=files)
            self._load_everywhere(version, target, self._tensors(staged, replies[self.applier]["files"]), metrics)
        except BaseException:
            for reader, one in zip(self.readers, staged):
                if one is not None:
                    reader.discard(one)
            raise
        with PhaseTimer(metrics, "commit"):
            for reader, one in zip(self.readers, staged):
                if one is not None:
                    self._commit_local(reader, one)

    def _commit_local(self, reader: DeltaReader, staged: StagedVersion) -> None:
        """Commit the host's local copy; a failure here is logged, not raised: every engine rank already
        serves the version, and a local copy left on the previous one is only a longer chain next time."""
        try:
            reader.commit(staged)
        except Exception:  # noqa: BLE001
            log.error("[inference rank %d] the engines hold version %d, but committing the local copy in %s "
                      "failed; it stays on version %s (the next sync applies from there)", self.rank,
                      staged.version, reader.local_dir, reader.version, exc_info=True)
            reader.discard(staged)

    def _stage(self, target: int, staged: list, metrics: SyncMetrics) -> tuple[Optional[list[str]], Optional[str]]:
        """Stage `target` from every stage's store (appliers); return the slot files, or the error."""
        if not self.readers:
            return None, None
        try:
            for reader in self.readers:
                staged.append(reader.stage(target))  # None: the local copy already holds it
                if staged[-1] is not None:
                    metrics.add("transfer", staged[-1].seconds["verify_files"])
                    metrics.add("apply", staged[-1].seconds["decode"])
                    metrics.bytes += staged[-1].payload_bytes
        except Exception as e:  # noqa: BLE001 — agreed on by the caller
            return None, describe(e, limit=2)
        return [s.file if s is not None else r.committed_file for s, r in zip(staged, self.readers)], None

    def _tensors(self, staged: list[Optional[StagedVersion]], files: list[str]) -> dict[str, torch.Tensor]:
        """Return the target's full tensors: the applier's staged views, or the applier's slot files."""
        tensors: dict[str, torch.Tensor] = {}
        if self.readers:
            for reader, one in zip(self.readers, staged):
                tensors.update(one.tensors if one is not None else reader.tensors())
        else:
            for path in files:
                tensors.update(read_slot(path))
        return tensors

    def _load_everywhere(self, version: int, target: int, tensors: dict[str, torch.Tensor],
                         metrics: SyncMetrics) -> None:
        """Load this rank's shards as `target`; agree; roll back here if another rank failed to load."""
        shards, error = {}, None
        try:
            shards = self.layout.params_from(tensors)
        except Exception as e:  # noqa: BLE001 — agreed on in the round: no rank loads
            error = f"cutting this rank's shards of version {target} failed: {describe(e, limit=3)}"
        self._agreed.load_agreed(version, shards, metrics, as_version=target, error=error)
