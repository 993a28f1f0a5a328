"""The inference-host reader: stage a published version into the local copy, verify it, commit it.

One `DeltaReader` per host (a file lock in the local directory). `stage`
plans the chain from the local copy's version to the target (or from the
newest snapshot when that chain is broken), registers the read in its lease
so garbage collection keeps those versions, checks every data file's size and
digest, decodes the chain into the slot that is not committed and checks every
decoded tensor's digest. Only then are the staged tensors handed out (views
into the memory-mapped slot, for the engine's `load_shards`); `commit` makes
the staged slot the local copy's version. Staging never touches the engine,
so it runs while the engine generates.

A reader that cannot reach a version (a file fails verification, the chain
is broken) remembers the damaged part, plans around it from then on, and asks
the writer for a snapshot (`storedir.request_snapshot`), so it recovers at
the next version the writer publishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import socket
import time
from typing import Optional

import numpy as np
import torch

import megatron_sync.transports.disk_delta.storedir as storedir
from megatron_sync.transports.disk_delta.chain import ChainPlan, Held, Lease, Step, plan_chain
from megatron_sync.transports.disk_delta.codec import decode_into
from megatron_sync.transports.disk_delta.errors import ChainError, CorruptFileError, VersionNotPublishedError
from megatron_sync.transports.disk_delta.fsio import FileLock
from megatron_sync.transports.disk_delta.localcopy import SlotFile, other_slot, read_state, slot_path, write_state
from megatron_sync.transports.disk_delta.manifest import MANIFEST, Chunk, Manifest, Part, TensorEntry, check_file, digest

_REBUILD = "delete the local directory {local} and apply again: the reader rebuilds it from the newest snapshot"


@dataclasses.dataclass
class StagedVersion:
    """A version decoded and verified in the uncommitted slot; `tensors` are views into that slot.

    The views stay valid until the reader stages into the same slot again (two versions later):
    an engine copies them in `load_shards`. Other ranks of the host open `file` read-only
    (`localcopy.read_slot`) once the applier has staged it.
    """

    version: int
    held: Held
    slot: str
    file: str
    plan: ChainPlan
    tensors: dict[str, torch.Tensor]
    payload_bytes: int  # bytes read from the store
    seconds: dict[str, float]  # "verify_files", "decode", and "commit" once committed (flush + fsync + state)


class DeltaReader:
    """Applies published versions from `root` to the host-local copy in `local_dir`."""

    def __init__(self, root: str, local_dir: str, *, reader_id: Optional[str] = None):
        self.root, self.local_dir = root, local_dir
        self.reader_id = storedir.check_reader_id(reader_id or socket.gethostname())
        os.makedirs(local_dir, exist_ok=True)
        self._lock = FileLock(
            os.path.join(local_dir, "applier.lock"), "the weight applier of this host",
            "run one DeltaReader per host (for example on its first inference rank); the other ranks read "
            f"the committed copy with megatron_sync.transports.disk_delta.localcopy.open_committed({local_dir!r})").acquire()
        try:
            self._held, self._slot = read_state(local_dir)
        except BaseException:
            self._lock.release()
            raise
        self._cache = storedir.ManifestCache(root)
        self._slots: dict[str, SlotFile] = {}
        self._staged: Optional[StagedVersion] = None
        self._damaged: set[Step] = set()  # parts whose files failed verification: plans avoid them
        self._write_lease(())

    @property
    def version(self) -> Optional[int]:
        """Return the committed version of the local copy (None when it holds none)."""
        return self._held.version if self._held else None

    @property
    def committed_file(self) -> Optional[str]:
        """Return the safetensors file holding the committed version (None before the first commit)."""
        return slot_path(self.local_dir, self._slot) if self._slot else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return views of the committed version's tensors (empty before the first commit)."""
        return self._slot_file(self._slot).tensors() if self._slot else {}

    def latest_published(self) -> Optional[int]:
        """Return the newest published version in the store (None when there is none)."""
        versions = storedir.published_versions(self.root)
        return versions[-1] if versions else None

    def apply(self, target: Optional[int] = None) -> Optional[StagedVersion]:
        """Stage and commit `target` (default: the newest); return it, or None when already held."""
        staged = self.stage(target)
        if staged is not None:
            self.commit(staged)
        return staged

    def stage(self, target: Optional[int] = None) -> Optional[StagedVersion]:
        """Decode and verify `target` (default: the newest) into the uncommitted slot; None when already held.

        Raises CorruptFileError / ChainError naming the file and the fix; then nothing is applied.
        """
        if self._staged is not None:
            raise RuntimeError(f"version {self._staged.version} is staged; commit or discard it first")
        try:
            return self._stage_target(target)
        except VersionNotPublishedError:
            raise
        except (CorruptFileError, ChainError) as exc:
            # Ask for a snapshot: the writer's next version then carries one and this reader
            # recovers from it instead of waiting for the next scheduled snapshot.
            wanted = target if target is not None else (self.latest_published() or 0)
            storedir.request_snapshot(self.root, self.reader_id, wanted, str(exc))
            raise

    def _stage_target(self, target: Optional[int]) -> Optional[StagedVersion]:
        for attempt in range(2):
            manifests, plan = self._plan(target)
            if not plan.steps:
                return None
            vanished = self._register_read(plan)
            if not vanished:
                break
            if attempt:
                raise ChainError(f"{self._where(vanished[0])} was garbage-collected while this reader planned "
                                 "its chain twice in a row; raise the writer's retention")
        try:
            self._staged = self._stage(plan, manifests)
        except BaseException:
            self._write_lease(())
            raise
        return self._staged

    def commit(self, staged: StagedVersion) -> None:
        """Make `staged` the local copy's committed version (flushes the slot, then switches atomically)."""
        if staged is not self._staged:
            raise ValueError(f"version {staged.version} is not the version staged by this reader")
        start = time.perf_counter()
        self._slots[staged.slot].flush()
        write_state(self.local_dir, staged.held, staged.slot)
        staged.seconds["commit"] = time.perf_counter() - start
        self._held, self._slot, self._staged = staged.held, staged.slot, None
        self._write_lease(())

    def discard(self, staged: StagedVersion) -> None:
        """Drop a staged version (for example when another rank failed); the committed one stays."""
        if staged is self._staged:
            self._staged = None
            self._write_lease(())

    def close(self) -> None:
        """Release the host's applier lock and the local files; the lease stays (it expires by itself)."""
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()
        self._lock.release()

    def __enter__(self) -> "DeltaReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- planning

    def _where(self, version: int) -> str:
        return storedir.version_path(self.root, version)

    def _plan(self, target: Optional[int]) -> tuple[dict[int, Manifest], ChainPlan]:
        manifests, broken = self._cache.scan()
        if target is None:
            if not manifests and not broken:
                raise VersionNotPublishedError(f"no version is published in {self.root} yet; wait for the writer")
            target = max([*manifests, *broken])
        if target in broken:
            raise broken[target]
        if target not in manifests:
            self._raise_unpublished(target, manifests)
        if self._held is not None and self._held.version > target:
            raise ChainError(f"the local copy in {self.local_dir} holds version {self._held.version}, newer than "
                             f"the requested {target}; versions only move forward (ask for the newest; if the store "
                             f"was recreated from scratch, delete {self.local_dir})")
        infos = {v: storedir.version_info(m) for v, m in manifests.items()}
        try:
            plan = self._plan_around_damage(infos, target)
        except ChainError as exc:
            if broken:  # a damaged manifest may be what broke the chain: say so
                raise ChainError(f"{exc}\nunreadable manifests: " + "; ".join(map(str, broken.values()))) from exc
            raise
        return manifests, plan

    def _plan_around_damage(self, infos, target: int) -> ChainPlan:
        """Plan around the parts that failed verification; with no way around them, try them again
        (their files may have been restored meanwhile)."""
        try:
            return plan_chain(infos, self._held, target, where=self._where, damaged=self._damaged)
        except ChainError:
            if not self._damaged:
                raise
            return plan_chain(infos, self._held, target, where=self._where)

    def _raise_unpublished(self, target: int, manifests: dict[int, Manifest]) -> None:
        leftovers = storedir.unpublished_leftovers(self.root, target)
        why = (f"; {leftovers[0]} is an unfinished write (the writer stopped before publishing it): a new writer "
               "removes it and publishes a snapshot") if leftovers else ""
        raise VersionNotPublishedError(
            f"version {target} is not published in {self.root} (no {self._where(target)}; published: "
            f"{sorted(manifests) or 'none'}){why}; apply a published version")

    def _register_read(self, plan: ChainPlan) -> list[int]:
        """Record the versions about to be read in this reader's lease; return any that vanished meanwhile."""
        with storedir.gc_lock(self.root):
            self._write_lease(plan.versions)
            return [v for v in plan.versions if not os.path.isdir(self._where(v))]

    def _write_lease(self, reading: tuple[int, ...]) -> None:
        storedir.write_lease(self.root, Lease(self.reader_id, self._held, tuple(reading)))

    # -- staging

    def _stage(self, plan: ChainPlan, manifests: dict[int, Manifest]) -> StagedVersion:
        start = time.perf_counter()
        files = self._verify_files(plan, manifests)
        verified = time.perf_counter()
        try:
            target = manifests[plan.target]
            slot = other_slot(self._slot)
            out = self._slot_file(slot, target.tensors)
            for i, step in enumerate(plan.steps):
                base = self._slot_file(self._slot) if i == 0 and step.part == "delta" else out
                with self._marking_damaged(step):
                    self._decode_step(manifests[step.version], step.part, base, out, files)
        finally:
            for data in files.values():
                if isinstance(data, mmap.mmap):
                    data.close()
        return StagedVersion(
            plan.target, Held(plan.target, target.state_digest), slot, out.path, plan, out.tensors(),
            sum(manifests[v].files[name][0] for v, name in files),
            {"verify_files": verified - start, "decode": time.perf_counter() - verified})

    def _verify_files(self, plan: ChainPlan, manifests: dict[int, Manifest]) -> dict[tuple[int, str], object]:
        """Map and check every data file the plan reads (size and digest); return them by (version, name)."""
        files: dict[tuple[int, str], object] = {}
        try:
            for step in plan.steps:
                manifest = manifests[step.version]
                for name in sorted({c.file for chunks in _part(manifest, step.part).chunks for c in chunks}):
                    size, expected = manifest.files[name]
                    with self._marking_damaged(step):
                        data = _map_file(os.path.join(self._where(step.version), name))
                        files[(step.version, name)] = data
                        check_file(self._where(step.version), name, size, expected, data)
        except BaseException:
            for data in files.values():
                if isinstance(data, mmap.mmap):
                    data.close()
            raise
        return files

    @contextlib.contextmanager
    def _marking_damaged(self, step: Step):
        """Remember `step` as damaged when its files fail verification, so later plans go around it."""
        try:
            yield
        except CorruptFileError:
            self._damaged.add(step)
            raise
        self._damaged.discard(step)

    def _decode_step(self, manifest: Manifest, part_name: str, base: SlotFile, out: SlotFile, files) -> None:
        part = _part(manifest, part_name)
        for entry, chunks in zip(manifest.tensors, part.chunks):
            target = out.bytes_of(entry.name)
            source = base.bytes_of(entry.name) if part_name == "delta" else None
            self._decode_tensor(manifest, entry, chunks, source, target, files)

    def _decode_tensor(self, manifest: Manifest, entry: TensorEntry, chunks: tuple[Chunk, ...],
                       base: Optional[np.ndarray], out: np.ndarray, files) -> None:
        folder = self._where(manifest.version)
        for k, chunk in enumerate(chunks):
            start = k * manifest.chunk_bytes
            end = min(start + manifest.chunk_bytes, entry.nbytes)
            payload = memoryview(files[(manifest.version, chunk.file)])[chunk.offset: chunk.offset + chunk.length]
            try:
                decode_into(chunk.encoding, payload, out[start:end], entry.itemsize,
                            None if base is None else base[start:end])
            except ValueError as exc:
                raise CorruptFileError(f"{os.path.join(folder, chunk.file)}: chunk {k} of {entry.name} does not "
                                       f"decode ({exc}); the store is damaged: let the writer publish a new "
                                       "snapshot (restart it)") from None
            finally:
                payload.release()
        if digest(out) != entry.digest:
            raise CorruptFileError(
                f"{entry.name} of version {manifest.version} decodes to bytes that do not match its digest in "
                f"{os.path.join(folder, MANIFEST)}: the local copy was not the delta's base (modified outside "
                f"{self.local_dir}?) or the store is damaged; " + _REBUILD.format(local=self.local_dir))

    def _slot_file(self, slot: str, entries: Optional[tuple[TensorEntry, ...]] = None) -> SlotFile:
        """Return slot `slot` mapped writable, (re)created empty when it does not hold `entries`."""
        current = self._slots.get(slot)
        if current is None and os.path.exists(slot_path(self.local_dir, slot)):
            current = self._slots[slot] = SlotFile(slot_path(self.local_dir, slot), writable=True)
        if entries is not None and (current is None or not current.matches(entries)):
            if current is not None:
                current.close()
            current = self._slots[slot] = SlotFile.create(slot_path(self.local_dir, slot), entries)
        if current is None:
            raise CorruptFileError(f"{slot_path(self.local_dir, slot)} is missing although {self.local_dir}/"
                                   "state.json commits it; " + _REBUILD.format(local=self.local_dir))
        return current


def _part(manifest: Manifest, name: str) -> Part:
    part = manifest.delta if name == "delta" else manifest.snapshot
    assert part is not None, f"version {manifest.version} has no {name} part"
    return part


def _map_file(path: str):
    """Return the file's bytes memory-mapped read-only (b"" for an empty file); CorruptFileError if missing."""
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual == 0:
                return b""
            return mmap.mmap(f.fileno(), actual, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise CorruptFileError(f"{path} is missing; the store's copy of this version is damaged: restore the "
                               "file, or let the writer publish a new snapshot (restart it)") from None
