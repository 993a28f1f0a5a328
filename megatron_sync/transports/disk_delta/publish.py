"""Encode one version of the replica and publish it as a version directory, atomically.

The version is written into a temporary directory (data files, then the
manifest, each fsynced) and becomes visible through one rename
(`fsio.publish_dir`). On any failure the temporary directory is removed and
nothing is published; a process killed before the rename leaves only a
temporary directory, which readers never look at.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import time
import uuid
from typing import Iterable, Iterator, Mapping, Optional

import numpy as np
import torch
import xxhash

import megatron_sync.transports.disk_delta.fsio as fsio
from megatron_sync.core.meta import FlatEntry
import megatron_sync.transports.disk_delta.storedir as storedir
from megatron_sync.transports.disk_delta.codec import Encoded, encode_delta, encode_snapshot
from megatron_sync.transports.disk_delta.manifest import (
    MANIFEST, SAFETENSORS_DTYPES, Chunk, Manifest, Part, TensorEntry, digest,
)
from megatron_sync.transports.disk_delta.options import WriterOptions


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """The tensors of one version, in the order given, packed into one flat byte buffer."""

    entries: tuple[FlatEntry, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "TensorLayout":
        """Return the layout of `tensors` ({hf_name: tensor}); raise ValueError for an unsupported dtype."""
        return cls.of_specs((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())

    @classmethod
    def of_specs(cls, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> "TensorLayout":
        """Return the layout of tensors given as (name, dtype, shape) (metadata only, no tensor needed)."""
        entries, offset = [], 0
        for name, dtype, shape in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold; "
                                 f"use one of {sorted(map(str, SAFETENSORS_DTYPES))}")
            nbytes = math.prod(shape) * dtype.itemsize
            entries.append(FlatEntry(name, tuple(shape), dtype, offset, nbytes))
            offset += nbytes
        return cls(tuple(entries), offset)

    def fill(self, buffer: np.ndarray, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` (same names, shapes and dtypes as this layout) into `buffer`."""
        for entry in self.entries:
            self.fill_one(buffer, entry, tensors[entry.name])

    def fill_one(self, buffer: np.ndarray, entry: FlatEntry, tensor: torch.Tensor) -> None:
        """Copy `tensor` (any device; `entry`'s shape and dtype) into its bytes of `buffer`."""
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"tensor {entry.name!r} is {tensor.dtype} {tuple(tensor.shape)}, the layout says "
                             f"{entry.dtype} {entry.shape}; a version's tensors keep their dtypes and shapes")
        flat = torch.from_numpy(buffer)
        flat[entry.offset: entry.offset + entry.nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))

    def view(self, buffer: np.ndarray, entry: FlatEntry) -> np.ndarray:
        """Return the bytes of `entry` inside `buffer`."""
        return buffer[entry.offset: entry.offset + entry.nbytes]


@dataclasses.dataclass(frozen=True)
class Base:
    """The previous published version, as the writer holds it: its manifest and its bytes."""

    manifest: Manifest
    layout: TensorLayout
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """Sizes and timings of one published version."""

    version: int
    raw_bytes: int
    delta_bytes: int  # 0 when the version has no delta part
    snapshot_bytes: int  # 0 when the version has no snapshot part
    seconds: float
    encodings: dict[str, int]  # encoding name -> raw bytes of the chunks it encoded (delta part)


class _DataFiles:
    """Appends payloads to `<prefix>-00000.bin`, `-00001.bin`, ... of at most `file_bytes` each, hashing them."""

    def __init__(self, folder: str, prefix: str, file_bytes: int):
        self.folder, self.prefix, self.file_bytes = folder, prefix, file_bytes
        self.files: dict[str, tuple[int, str]] = {}
        self._fd: Optional[int] = None
        self._name, self._size, self._hash = "", 0, xxhash.xxh3_128()

    def append(self, encoded: Encoded) -> Chunk:
        """Write `encoded`'s payload and return where it lies."""
        if self._fd is None or (self._size and self._size + encoded.size > self.file_bytes):
            self._roll()
        fsio.write_all(self._fd, encoded.payload, os.path.join(self.folder, self._name))
        self._hash.update(encoded.payload)
        chunk = Chunk(encoded.name, self._name, self._size, encoded.size)
        self._size += encoded.size
        return chunk

    def _roll(self) -> None:
        self.close()
        self._name = f"{self.prefix}-{len(self.files):05d}.bin"
        self._fd = os.open(os.path.join(self.folder, self._name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._size, self._hash = 0, xxhash.xxh3_128()

    def close(self) -> None:
        """Fsync and close the current file (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.files[self._name] = (self._size, self._hash.hexdigest())


def _ordered_map(fn, items, executor: Optional[concurrent.futures.Executor], ahead: int) -> Iterator:
    """Yield `fn(item)` in order; with an executor, computing up to `ahead` items in advance."""
    if executor is None:
        yield from map(fn, items)
        return
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(executor.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # on a write failure, wait for the chunks in flight before the directory is removed
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)


def _chunks(layout: TensorLayout, chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """Yield (tensor index, start, end) byte ranges; an empty tensor is one empty chunk."""
    for index, entry in enumerate(layout.entries):
        for start in range(0, max(entry.nbytes, 1), chunk_bytes):
            yield index, start, min(start + chunk_bytes, entry.nbytes)


def write_version(root: str, version: int, layout: TensorLayout, data: np.ndarray, *,
                  base: Optional[Base], snapshot: bool, options: WriterOptions,
                  executor: Optional[concurrent.futures.Executor] = None) -> tuple[Manifest, PublishStats]:
    """Encode `data` (laid out by `layout`) and publish it as `version` under `root`; return its manifest.

    With `base`, the version carries a delta part against it; with `snapshot`, a snapshot part.
    Chunks are encoded on `executor` when given (else in this thread). Raises StoreWriteError
    (disk full, ...) with nothing published.
    """
    assert base is not None or snapshot, "a version needs a delta part, a snapshot part, or both"
    assert base is None or base.layout == layout, "a delta needs the base's exact tensor layout"
    start = time.perf_counter()
    tmp = storedir.tmp_path(root, version, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        manifest, encodings = _write_parts(tmp, version, layout, data, base, snapshot, options, executor)
        _write_manifest(tmp, manifest)
        fsio.publish_dir(tmp, storedir.version_path(root, version))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats = PublishStats(version, layout.nbytes, manifest.part_bytes(manifest.delta),
                         manifest.part_bytes(manifest.snapshot), time.perf_counter() - start, encodings)
    return manifest, stats


def _write_parts(tmp: str, version: int, layout: TensorLayout, data: np.ndarray, base: Optional[Base],
                 snapshot: bool, options: WriterOptions, executor) -> tuple[Manifest, dict[str, int]]:
    delta_files = _DataFiles(tmp, "delta", options.file_bytes) if base else None
    snapshot_files = _DataFiles(tmp, "snapshot", options.file_bytes) if snapshot else None
    delta_chunks = [[] for _ in layout.entries]
    snapshot_chunks = [[] for _ in layout.entries]
    encodings: collections.Counter = collections.Counter()

    def encode(task):
        index, start, end = task
        entry = layout.entries[index]
        new, itemsize = layout.view(data, entry)[start:end], entry.dtype.itemsize
        opts = dict(choice=options.encoding, level=options.zstd_level)
        delta = encode_delta(new, layout.view(base.data, entry)[start:end], itemsize, **opts) if base else None
        return task, delta, encode_snapshot(new, itemsize, **opts) if snapshot else None

    results = _ordered_map(encode, _chunks(layout, options.chunk_bytes), executor, 2 * options.encode_threads)
    try:
        for (index, start, end), delta, full in results:
            if delta is not None:
                delta_chunks[index].append(delta_files.append(delta))
                encodings[delta.name] += end - start
            if full is not None:
                snapshot_chunks[index].append(snapshot_files.append(full))
    finally:
        results.close()
        for files in (delta_files, snapshot_files):
            if files is not None:
                files.close()
    tensors = tuple(
        TensorEntry(e.name, SAFETENSORS_DTYPES[e.dtype], e.shape, digest(layout.view(data, e)))
        for e in layout.entries
    )
    manifest = Manifest(
        version=version, tensors=tensors, chunk_bytes=options.chunk_bytes, created=time.time(),
        files={**(delta_files.files if delta_files else {}), **(snapshot_files.files if snapshot_files else {})},
        delta=Part(_freeze(delta_chunks), base.manifest.version, base.manifest.state_digest) if base else None,
        snapshot=Part(_freeze(snapshot_chunks)) if snapshot else None,
    )
    return manifest, dict(encodings)


def _freeze(chunks: list[list[Chunk]]) -> tuple[tuple[Chunk, ...], ...]:
    return tuple(tuple(c) for c in chunks)


def _write_manifest(tmp: str, manifest: Manifest) -> None:
    path = os.path.join(tmp, MANIFEST)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fsio.write_all(fd, json.dumps(manifest.to_json(), indent=1).encode(), path)
        os.fsync(fd)
    finally:
        os.close(fd)
