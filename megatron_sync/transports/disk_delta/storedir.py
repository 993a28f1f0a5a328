"""The shared store directory: published versions, reader leases, and garbage collection.

    <root>/
      v00000007/             a published version: manifest.json + data files
      .tmp-v00000008-...     a version being written (never read; removed by the next writer)
      .trash-v00000002-...   a version being deleted (renamed out of sight first)
      leases/<reader>.json   what each reader holds and is reading
      requests/<reader>.json a reader that could not reach a version asks for a snapshot
      failed/v00000008.json  the writer could not publish this version (its error): readers stop waiting
      writer.lock            one writer per root, held while it lives: readers see it gone (`writer_running`)
      gc.lock                taken by garbage collection, and by a reader while it registers a read
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import time
from typing import Optional, Sequence

import megatron_sync.transports.disk_delta.fsio as fsio
from megatron_sync.transports.disk_delta.chain import Held, Lease, VersionInfo, versions_to_keep
from megatron_sync.transports.disk_delta.errors import CorruptFileError
from megatron_sync.transports.disk_delta.manifest import Manifest, parse_version_dirname, read_manifest, version_dirname

TMP_PREFIX = ".tmp-"
LEASES = "leases"
REQUESTS = "requests"
FAILED = "failed"
WRITER_LOCK = "writer.lock"
WRITER_LOCK_WAIT_S = 2.0  # how long a new writer waits for its lock: readers look at it (`writer_running`)
_SAFE_READER = re.compile(r"[A-Za-z0-9._-]+")


def writer_running(root: str) -> bool:
    """True while a writer holds `root`'s writer lock: it lives (a process that exits or dies releases it)."""
    return fsio.lock_held(os.path.join(root, WRITER_LOCK))


def trainer_gone(stores: Sequence[str]) -> Optional[str]:
    """Return why the trainer is gone when a stage's store has no live writer (its process exited or died,
    which releases the writer lock), else None."""
    for store in stores:
        if not writer_running(store):
            return (f"the trainer is gone: no process holds {os.path.join(store, WRITER_LOCK)} (the "
                    "trainer's delta writer of that stage exited or was killed)")
    return None


def version_path(root: str, version: int) -> str:
    """Return the directory of a published `version` under `root`."""
    return os.path.join(root, version_dirname(version))


def tmp_path(root: str, version: int, token: str) -> str:
    """Return the temporary directory a writer fills before publishing `version`."""
    return os.path.join(root, f"{TMP_PREFIX}{version_dirname(version)}-{token}")


def published_versions(root: str) -> list[int]:
    """Return the published version numbers under `root`, oldest first (temporaries and trash excluded)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(v for v in map(parse_version_dirname, names) if v is not None)


def unpublished_leftovers(root: str, version: int) -> list[str]:
    """Return temporary directories of `version` left by a writer that died before publishing it."""
    prefix = f"{TMP_PREFIX}{version_dirname(version)}-"
    try:
        return sorted(os.path.join(root, n) for n in os.listdir(root) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_leftovers(root: str) -> list[str]:
    """Remove every temporary and trash directory under `root` (only the single writer may call this)."""
    removed = []
    for name in os.listdir(root):
        if name.startswith((TMP_PREFIX, ".trash-")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def version_info(manifest: Manifest) -> VersionInfo:
    """Return what chain planning needs from a manifest."""
    delta = manifest.delta
    return VersionInfo(manifest.version, manifest.state_digest, manifest.snapshot is not None,
                       delta.base_version if delta else None, delta.base_state_digest if delta else None)


class ManifestCache:
    """Manifests of published versions, read once per version directory (a published version never
    changes; a directory replaced under the same name, by a new run in the same root, is read again)."""

    def __init__(self, root: str):
        self.root = root
        self._manifests: dict[int, tuple[tuple[int, int], Manifest]] = {}  # version -> (dir identity, manifest)

    def scan(self) -> tuple[dict[int, Manifest], dict[int, CorruptFileError]]:
        """Return the readable manifests of every published version, and the error of each unreadable one."""
        manifests, broken = {}, {}
        for version in published_versions(self.root):
            path = version_path(self.root, version)
            try:
                stat = os.stat(path)
                identity = (stat.st_ino, stat.st_ctime_ns)
                if self._manifests.get(version, (None,))[0] != identity:
                    self._manifests[version] = (identity, read_manifest(path))
                manifests[version] = self._manifests[version][1]
            except FileNotFoundError:
                continue  # deleted meanwhile
            except CorruptFileError as exc:
                if os.path.isdir(path):
                    broken[version] = exc
        self._manifests = {v: self._manifests[v] for v in manifests}
        return manifests, broken


# ----------------------------------------------------------------------------- leases


def check_reader_id(reader: str) -> str:
    """Return `reader` if it is usable as a lease file name; raise ValueError otherwise."""
    if not _SAFE_READER.fullmatch(reader):
        raise ValueError(f"reader id must match {_SAFE_READER.pattern} (it names a lease file), got {reader!r}")
    return reader


def write_lease(root: str, lease: Lease) -> None:
    """Record atomically what reader `lease.reader` holds and is reading."""
    os.makedirs(os.path.join(root, LEASES), exist_ok=True)
    held = None if lease.held is None else [lease.held.version, lease.held.state_digest]
    fsio.write_json_atomic(os.path.join(root, LEASES, f"{lease.reader}.json"), {
        "reader": lease.reader, "held": held, "reading": list(lease.reading),
        "host": socket.gethostname(), "pid": os.getpid(), "updated": time.time(),
    })


def remove_lease(root: str, reader: str) -> None:
    """Forget reader `reader` (it no longer needs anything kept)."""
    try:
        os.unlink(os.path.join(root, LEASES, f"{reader}.json"))
    except FileNotFoundError:
        pass


def read_leases(root: str, ttl_s: float, now: Optional[float] = None) -> list[Lease]:
    """Return the leases refreshed within `ttl_s` seconds (older ones belong to readers presumed gone)."""
    now = time.time() if now is None else now
    leases = []
    for _, obj in _json_files(os.path.join(root, LEASES)):
        if obj is None:
            continue  # being replaced right now, or damaged: it protects nothing
        if now - float(obj.get("updated", 0)) <= ttl_s:
            held = Held(*obj["held"]) if obj.get("held") else None
            leases.append(Lease(obj["reader"], held, tuple(obj.get("reading", ()))))
    return leases


def gc_lock(root: str) -> fsio.FileLock:
    """Return the lock garbage collection holds, and readers take while registering a read."""
    return fsio.FileLock(os.path.join(root, "gc.lock"), "garbage collection of the delta store",
                         "wait for it to finish")


def collect_garbage(root: str, retention: int, lease_ttl_s: float, cache: ManifestCache) -> list[int]:
    """Delete the published versions no reader needs beyond the newest `retention`; return them."""
    with gc_lock(root):
        manifests, broken = cache.scan()
        infos = {v: version_info(m) for v, m in manifests.items()}
        keep = versions_to_keep(infos, retention, read_leases(root, lease_ttl_s))
        doomed = sorted(v for v in set(infos) | set(broken) if v not in keep and v < max(infos, default=0))
        for version in doomed:
            fsio.remove_dir(version_path(root, version))
    return doomed



# ----------------------------------------------------------------------------- snapshot requests


@dataclasses.dataclass(frozen=True)
class SnapshotRequest:
    """A reader that could not reach `version` asks the writer to publish a snapshot."""

    reader: str
    version: int
    reason: str
    name: str  # the request's file name under requests/


def request_snapshot(root: str, reader: str, version: int, reason: str) -> None:
    """Ask the writer of `root` to make its next version a snapshot (reader `reader` cannot reach `version`)."""
    os.makedirs(os.path.join(root, REQUESTS), exist_ok=True)
    fsio.write_json_atomic(os.path.join(root, REQUESTS, f"{reader}.json"), {
        "reader": reader, "version": version, "reason": reason[:500], "host": socket.gethostname(),
        "pid": os.getpid(), "time": time.time(),
    })


def snapshot_requests(root: str) -> list[SnapshotRequest]:
    """Return the pending snapshot requests of `root` (an unreadable one still counts as a request)."""
    requests = []
    for name, obj in _json_files(os.path.join(root, REQUESTS)):
        try:
            requests.append(SnapshotRequest(str(obj["reader"]), int(obj["version"]), str(obj["reason"]), name))
        except (KeyError, TypeError, ValueError):
            requests.append(SnapshotRequest(name[:-5], -1, "unreadable request", name))
    return requests


def clear_snapshot_requests(root: str, requests: list[SnapshotRequest]) -> None:
    """Remove requests a published snapshot answered (a reader that fails again asks again)."""
    for request in requests:
        try:
            os.unlink(os.path.join(root, REQUESTS, request.name))
        except FileNotFoundError:
            pass


def mark_failed(root: str, version: int, error: str) -> None:
    """Record that the writer of `root` could not publish `version` (a small file: it fits where the version
    did not; raises OSError when even that cannot be written)."""
    os.makedirs(os.path.join(root, FAILED), exist_ok=True)
    fsio.write_json_atomic(os.path.join(root, FAILED, f"{version_dirname(version)}.json"),
                           {"version": version, "error": error[:500], "time": time.time()})


def failed_versions(root: str) -> dict[int, str]:
    """Return {version: the writer's error} of the versions the writer of `root` could not publish."""
    out = {}
    for name, obj in _json_files(os.path.join(root, FAILED)):
        version = parse_version_dirname(name[:-5])
        if version is not None:
            out[version] = str(obj.get("error")) if isinstance(obj, dict) else "unreadable failure record"
    return out


def clear_failed(root: str, below: int) -> None:
    """Remove the failure records of versions below `below` (a later version was published)."""
    for version in failed_versions(root):
        if version < below:
            try:
                os.unlink(os.path.join(root, FAILED, f"{version_dirname(version)}.json"))
            except FileNotFoundError:
                pass


def _json_files(folder: str):
    """Yield (name, object) for every *.json file in `folder`, object None when it is unreadable
    (being replaced right now, or damaged); a file removed meanwhile is skipped."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                yield name, json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            yield name, None
