"""A version goes live on every inference rank or on none: the two agreement rounds of a sync.

Round 1, "all intact": every transport rank says whether it holds the whole version intact
(a sender: whether it sent all of it). Only if every rank does, each inference rank keeps
its live shards for a rollback (the caller's own copy of them when it holds one, such as the
bucket receiver's other staging set; else `engine.snapshot()`) and commits the staged ones.
Round 2, "all loaded": every rank says whether its commit worked, and (with a `check`) whether what the
engine now holds is what was sent (`layout.loaded`); if any failed, the ranks that committed load their
previous shards back, so no engine serves a mix of versions. Any failure raises the same `SyncAbortedError`
on every rank. Every transport's sender and receiver run these rounds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.errors import SyncAbortedError
from megatron_sync.core.lifecycle import uninterrupted
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.layout.staging import HeldShards, StagedCopy

if TYPE_CHECKING:
    from megatron_sync.engines.base import EngineAdapter

Commit = Callable[[dict[str, torch.Tensor], int], None]
"""Make staged shards live as a version: `commit(shards, version)` (an engine's load, or a serving loop's)."""


class Agreeing(Protocol):
    """What the rounds need of a transport endpoint: its rank and an agreement over its group."""

    rank: int

    def agree(self, error: Optional[str], *, what: str, failure: Any = None) -> None: ...


Agree = Callable[[int, Optional[str]], None]
"""One agreement round of the sync of a version: (version, this rank's error or None); raises the same
SyncAbortedError on every rank when any rank failed."""


def transport_agree(transport: "Agreeing") -> Agree:
    """Return the agreement round over `transport`'s group."""
    def agree(version: int, error: Optional[str]) -> None:
        transport.agree(error, what=f"sync of version {version}",
                        failure=lambda failures: SyncAbortedError(version, failures))
    return agree


def sender_rounds(transport: "Agreeing", version: int, error: Optional[str]) -> None:
    """Take a sender's part in both rounds: `error` (None: all sent) in round 1, ok in round 2.

    A stop signal (SIGTERM) arriving meanwhile is raised once both rounds are done: a sender that left
    between them would leave the engines unable to tell whether the version went live everywhere."""
    agree = transport_agree(transport)
    with uninterrupted():
        for status in (error, None):
            agree(version, status)


class AgreedCommit:
    """An inference rank's part in both rounds around `commit(staged shards, version)`.

    `agree` runs one round (`transport_agree(transport)` for a transport's group; the disk-delta
    receiver passes its own all-gather); `rank` names this rank in failures. `commit` defaults
    to `engine.load_shards` (a serving loop passes its own, which applies the version at a
    generation step boundary). With `rollback` the live shards are kept before each commit:
    `live_shards(engine.version)` when the caller holds them (no copy), else a copy
    (`engine.snapshot()`, one extra copy of this rank's shards).
    """

    def __init__(self, agree: Agree, rank: int, engine: "EngineAdapter", commit: Optional[Commit] = None, *,
                 rollback: bool = True,
                 live_shards: Optional[Callable[[int], Optional[Mapping[str, torch.Tensor]]]] = None,
                 check: Optional[Callable[[int], Optional[str]]] = None) -> None:
        self.agree, self.rank, self.engine, self.rollback = agree, rank, engine, rollback
        self.commit = commit if commit is not None else engine.load_shards
        self.live_shards = live_shards
        self.check = check  # check(version): what the loaded engine holds that it should not, or None
        self.snapshots_taken = 0  # engine.snapshot() copies made

    @classmethod
    def over(cls, transport: "Agreeing", engine: "EngineAdapter", commit: Optional[Commit] = None,
             **kwargs: Any) -> "AgreedCommit":
        """Return the rounds over `transport`'s group."""
        return cls(transport_agree(transport), transport.rank, engine, commit, **kwargs)

    def __call__(self, version: int, error: Optional[str], staged: Mapping[str, torch.Tensor],
                 metrics: SyncMetrics) -> None:
        """Run both rounds with this rank's receive `error` (None: `staged` holds the whole version intact)."""
        with PhaseTimer(metrics, "commit", ("commit", -1)):
            self.agree(version, error)
        self.load_agreed(version, staged, metrics)

    def load_agreed(self, version: int, staged: Mapping[str, torch.Tensor], metrics: SyncMetrics, *,
                    as_version: Optional[int] = None, error: Optional[str] = None) -> None:
        """Round 2: commit `staged` as `as_version` (default: `version`), agree every rank loaded it, and
        roll back here when another rank did not. `error`: this rank failed before it could load (it
        loads nothing and takes part in the round with that error)."""
        old_version, snapshot, load_error = self.engine.version, None, error
        try:
            if load_error is None:
                with PhaseTimer(metrics, "commit"):  # keeping the rollback source is part of committing
                    snapshot = self._snapshot()
        except Exception as e:  # noqa: BLE001 — agreed on below; nothing was loaded
            load_error = f"keeping the live shards for a rollback failed: {describe(e, limit=3)}"
        if load_error is None:
            # held: may run in place; staged in the only set: copied, with the version before it at hand
            shards = (HeldShards(staged) if isinstance(staged, HeldShards)
                      else staged if isinstance(staged, StagedCopy) else dict(staged))
            load_error = self._load(shards, version if as_version is None else as_version, metrics)
            if load_error is None and self.check is not None:
                load_error = self._checked(version, snapshot, old_version, metrics)
        metrics.ended_at = time.time()  # this rank is done with the version: it goes live once every rank is
        try:
            with PhaseTimer(metrics, "commit", ("commit", -1)):
                self.agree(version, load_error)
        except SyncAbortedError as e:
            if load_error is None:  # this rank loaded it, another did not: go back
                problem = self._roll_back(snapshot, old_version)
                if problem is not None:
                    raise SyncAbortedError(version, [*e.failures, (self.rank, problem)]) from e
            raise

    def _snapshot(self) -> Optional[Mapping[str, torch.Tensor]]:
        """Return the live shards as they are before a load, so a load that fails elsewhere can be
        undone here: the caller's own copy when it has one, else a snapshot."""
        if not self.rollback:
            return None
        held = self.live_shards(self.engine.version) if self.live_shards is not None else None
        if held is not None:
            return held
        self.snapshots_taken += 1
        return self.engine.snapshot() or None

    def _load(self, staged: dict[str, torch.Tensor], version: int, metrics: SyncMetrics) -> Optional[str]:
        try:
            with PhaseTimer(metrics, "apply", ("load", -1)):
                self.commit(staged, version)
        except Exception as e:  # noqa: BLE001 — agreed on, then raised on every rank
            return (f"commit failed: {describe(e, limit=3)} (ranks that loaded the new version "
                    "roll back to the previous one)")
        return None

    def _checked(self, version: int, snapshot: Optional[Mapping[str, torch.Tensor]], old_version: int,
                 metrics: SyncMetrics) -> Optional[str]:
        """Run the post-load check; when it fails, go back to the previous version here at once (this rank then
        takes part in round 2 as one that did not load) and return what failed."""
        with PhaseTimer(metrics, "verify"):
            try:
                problem = self.check(version)
            except Exception as e:  # noqa: BLE001 — a check that cannot run fails the version, agreed on
                problem = f"checking the loaded weights failed: {describe(e, limit=3)}"
        if problem is None:
            return None
        undone = self._roll_back(snapshot, old_version)
        return problem + ("" if undone is None else f"; {undone}")

    def _roll_back(self, snapshot: Optional[Mapping[str, torch.Tensor]], old_version: int) -> Optional[str]:
        """Load the snapshot back; return what went wrong (None when this rank is back on `old_version`)."""
        if not snapshot:
            return ("loaded the new version and has no snapshot to roll back to; this engine rank now "
                    "differs from ranks that failed to load")
        try:
            self.commit(snapshot, old_version)
        except Exception as e:  # noqa: BLE001 — reported with the sync's failures
            return f"rolling back to version {old_version} failed: {e}"
        return None
