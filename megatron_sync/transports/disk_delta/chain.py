"""Pure planning over the published versions: which versions to apply, and which ones to keep.

Inputs are metadata only (`VersionInfo` per published version, what a reader
holds), so both functions are tested as tables without touching a disk.

A reader prefers the chain of deltas from the version it holds; when that
chain is broken (a gap, a delta against a different base, a local copy that
is missing, ahead of the target or holds other content) it falls back to the
newest snapshot in the target's ancestry plus the deltas after it, and the
plan says why.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Callable, Iterable, Mapping, Optional

from megatron_sync.transports.disk_delta.errors import ChainError, VersionNotPublishedError


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """What planning needs from one published manifest."""

    version: int
    state_digest: str
    has_snapshot: bool
    base_version: Optional[int] = None  # None: the version has no delta part
    base_state_digest: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Held:
    """The version a reader's local copy holds, and the digest of its content."""

    version: int
    state_digest: str


@dataclasses.dataclass(frozen=True)
class Step:
    """Apply one version's `part` ("delta" or "snapshot")."""

    version: int
    part: str


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """The steps that take a local copy to `target` (empty: it already holds it)."""

    target: int
    steps: tuple[Step, ...]
    fallback_reason: Optional[str] = None  # why the chain does not start at the local copy

    @property
    def versions(self) -> tuple[int, ...]:
        """Return the versions the steps read, oldest first."""
        return tuple(s.version for s in self.steps)


@dataclasses.dataclass(frozen=True)
class Lease:
    """What one registered reader holds and is reading right now."""

    reader: str
    held: Optional[Held]
    reading: tuple[int, ...] = ()


def _plain(version: int) -> str:
    return f"version {version}"


def plan_chain(published: Mapping[int, VersionInfo], held: Optional[Held], target: int,
               where: Callable[[int], str] = _plain, damaged: AbstractSet[Step] = frozenset()) -> ChainPlan:
    """Return the steps from `held` (or from a snapshot) to `target`; raise ChainError when none exist.

    `where(version)` names a version in messages (for example its directory); `damaged` holds
    the steps whose files failed verification before, which the plan avoids.
    """
    if target not in published:
        raise VersionNotPublishedError(
            f"{where(target)} is not published (published: {sorted(published) or 'none'}); wait for the "
            "writer to publish it, or ask for one of the published versions")
    if held is not None and held.version == target and held.state_digest == published[target].state_digest:
        return ChainPlan(target, ())
    steps, reason = _delta_path(published, held, target, where, damaged)
    if steps is not None:
        return ChainPlan(target, tuple(steps))
    return ChainPlan(target, tuple(_snapshot_path(published, target, where, damaged)), reason)


def _delta_path(published, held: Optional[Held], target: int, where,
                damaged: AbstractSet[Step] = frozenset()) -> tuple[Optional[list[Step]], str]:
    """Return the deltas from `held` to `target` (oldest first), or None and why there are none."""
    if held is None:
        return None, "the local copy holds no version yet"
    if held.version >= target:
        what = "holds other content under the same number" if held.version == target else "is ahead of it"
        return None, f"the local copy (version {held.version}) {what}"
    steps, version = [], target
    while version != held.version:
        info = published.get(version)
        if info is None:
            return None, f"the chain back from version {target} has a gap: {where(version)} is missing"
        if info.base_version is None:
            return None, f"{where(version)} is a snapshot without a delta part"
        if Step(version, "delta") in damaged:
            return None, f"the delta part of {where(version)} failed verification"
        if info.base_version < held.version:
            return None, (f"{where(version)} is a delta against version {info.base_version}, which is older "
                          f"than the local copy's version {held.version} (wrong base)")
        if info.base_version == held.version and info.base_state_digest != held.state_digest:
            return None, (f"{where(version)} is a delta against version {held.version} with other content than "
                          f"the local copy's (base mismatch: another run, or a local copy modified outside)")
        base = published.get(info.base_version)
        if info.base_version != held.version and base and base.state_digest != info.base_state_digest:
            return None, f"{where(version)} is a delta against other content than the published version {base.version}"
        steps.append(Step(version, "delta"))
        version = info.base_version
    return steps[::-1], ""


def _snapshot_path(published, target: int, where, damaged: AbstractSet[Step] = frozenset()) -> list[Step]:
    """Return the newest intact snapshot in `target`'s ancestry and the deltas after it (oldest first)."""
    steps, version = [], target
    while True:
        info = published[version]
        if info.has_snapshot and Step(version, "snapshot") not in damaged:
            return [Step(version, "snapshot")] + steps[::-1]
        if Step(version, "delta") in damaged or info.base_version is None:
            raise ChainError(
                f"cannot reach version {target}: {where(version)} failed verification and no intact snapshot lies "
                "after it; the writer's next version carries a snapshot (this reader asked for one): apply that")
        base = published.get(info.base_version)
        if base is None:
            raise ChainError(
                f"cannot reach version {target}: {where(info.base_version)}, the base of {where(version)}, is "
                "missing and no snapshot lies between them; let the writer publish a snapshot (restart it or "
                "lower snapshot_every) or raise retention so bases outlive their deltas")
        if base.state_digest != info.base_state_digest:
            raise ChainError(
                f"cannot reach version {target}: {where(version)} is a delta against other content than the "
                f"published {where(info.base_version)} (wrong base); the store mixes two runs: give each run "
                "its own directory, or let the writer publish a snapshot")
        steps.append(Step(version, "delta"))
        version = info.base_version


def ancestry_to_snapshot(published: Mapping[int, VersionInfo], version: int) -> set[int]:
    """Return `version` and its bases back to the first snapshot (or to a gap)."""
    kept = set()
    while version in published and version not in kept:
        kept.add(version)
        info = published[version]
        if info.has_snapshot or info.base_version is None:
            break
        version = info.base_version
    return kept


def versions_to_keep(published: Mapping[int, VersionInfo], retention: int, leases: Iterable[Lease]) -> set[int]:
    """Return the published versions garbage collection must keep.

    Kept: the newest `retention` versions, each with its ancestry back to a snapshot
    (so every kept version is reachable from scratch); for every live lease, the
    versions it is reading and the deltas it needs to reach the newest version.
    """
    if retention < 1:
        raise ValueError(f"retention must be >= 1, got {retention}")
    if not published:
        return set()
    keep: set[int] = set()
    for version in sorted(published)[-retention:]:
        keep |= ancestry_to_snapshot(published, version)
    latest = max(published)
    for lease in leases:
        keep |= set(lease.reading) & set(published)
        steps, _ = _delta_path(published, lease.held, latest, _plain)
        keep |= {s.version for s in steps or ()}
    return keep
