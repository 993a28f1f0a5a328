"""The manifest of one published version: what each tensor is, how it is encoded, and every digest.

A version directory `v00000012/` holds `manifest.json` and the data files it
names. A version always carries the full list of tensors with an xxh3-128
digest of each tensor's decoded bytes, and one or both of two parts:

- `delta`: every tensor encoded against `base_version` (whose state digest
  is recorded, so a reader checks the content of its base, not only its number);
- `snapshot`: every tensor encoded without a base.

A tensor is split into chunks of `chunk_bytes` (the last one shorter); each
chunk has its own encoding and lives at (file, offset, length) in a data file.
`files` gives every data file's size and digest, and `manifest_digest` covers
the manifest itself, so a flipped byte anywhere is detected before anything
is decoded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Optional

import torch
import xxhash

from megatron_sync.transports.disk_delta.errors import CorruptFileError

FORMAT = "megatron-sync-delta/1"
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"v(\d{8,})")

# torch dtype <-> safetensors dtype name (the local copy is a safetensors file).
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def version_dirname(version: int) -> str:
    """Return the directory name of `version` (zero-padded so names sort as numbers)."""
    return f"v{version:08d}"


def parse_version_dirname(name: str) -> Optional[int]:
    """Return the version a directory name stands for, or None for anything else (temporaries, trash)."""
    match = _VERSION_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def digest(data) -> str:
    """Return the xxh3-128 hex digest of a bytes-like object."""
    return xxhash.xxh3_128(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: name, safetensors dtype, shape and the digest of its decoded bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str

    @property
    def itemsize(self) -> int:
        """Return the element size in bytes."""
        return TORCH_DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """Return the tensor's size in bytes."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.itemsize


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One encoded chunk: its encoding and where its payload lies."""

    encoding: str
    file: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Part:
    """The tensors of a version in one form (a delta against a base, or a snapshot): chunks per tensor."""

    chunks: tuple[tuple[Chunk, ...], ...]  # aligned with Manifest.tensors
    base_version: Optional[int] = None
    base_state_digest: Optional[str] = None


def state_digest(tensors: Iterable[TensorEntry]) -> str:
    """Return the digest of a whole version's content: every tensor's name, dtype, shape and digest."""
    lines = "".join(f"{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.digest}\n" for t in tensors)
    return digest(lines.encode())


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to verify and decode one version."""

    version: int
    tensors: tuple[TensorEntry, ...]
    chunk_bytes: int
    files: dict[str, tuple[int, str]]  # file name -> (size, digest)
    delta: Optional[Part] = None
    snapshot: Optional[Part] = None
    created: float = 0.0

    @property
    def state_digest(self) -> str:
        """Return the digest of the whole version's content (see `state_digest`)."""
        return state_digest(self.tensors)

    @property
    def base_version(self) -> Optional[int]:
        """Return the version the delta part is against (None without a delta part)."""
        return self.delta.base_version if self.delta else None

    def part_bytes(self, part: Optional[Part]) -> int:
        """Return the payload bytes of `part` (0 when absent)."""
        return sum(c.length for chunks in (part.chunks if part else ()) for c in chunks)

    def to_json(self) -> dict[str, Any]:
        """Return the manifest as a JSON object, `manifest_digest` included."""
        body = {
            "format": FORMAT, "version": self.version, "created": self.created,
            "chunk_bytes": self.chunk_bytes, "state_digest": self.state_digest,
            "tensors": [[t.name, t.dtype, list(t.shape), t.digest] for t in self.tensors],
            "files": {name: list(v) for name, v in sorted(self.files.items())},
            "delta": _part_json(self.delta), "snapshot": _part_json(self.snapshot),
        }
        return {**body, "manifest_digest": _json_digest(body)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Manifest":
        """Return the manifest in `obj`; raise ValueError when its digest or format is wrong."""
        body = {k: v for k, v in obj.items() if k != "manifest_digest"}
        if obj.get("format") != FORMAT:
            raise ValueError(f"format is {obj.get('format')!r}, expected {FORMAT!r}")
        if obj.get("manifest_digest") != _json_digest(body):
            raise ValueError("manifest_digest does not match the manifest's content")
        manifest = cls(
            version=int(obj["version"]), chunk_bytes=int(obj["chunk_bytes"]), created=float(obj["created"]),
            tensors=tuple(TensorEntry(n, d, tuple(s), h) for n, d, s, h in obj["tensors"]),
            files={name: (int(size), h) for name, (size, h) in obj["files"].items()},
            delta=_part_from_json(obj["delta"]), snapshot=_part_from_json(obj["snapshot"]),
        )
        if manifest.state_digest != obj["state_digest"]:
            raise ValueError("state_digest does not match the tensor list")
        return manifest


def _json_digest(body: dict[str, Any]) -> str:
    return digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _part_json(part: Optional[Part]) -> Optional[dict[str, Any]]:
    if part is None:
        return None
    return {"base_version": part.base_version, "base_state_digest": part.base_state_digest,
            "chunks": [[[c.encoding, c.file, c.offset, c.length] for c in chunks] for chunks in part.chunks]}


def _part_from_json(obj: Optional[dict[str, Any]]) -> Optional[Part]:
    if obj is None:
        return None
    chunks = tuple(tuple(Chunk(*c) for c in tensor) for tensor in obj["chunks"])
    return Part(chunks, obj["base_version"], obj["base_state_digest"])


def read_manifest(version_dir: str) -> Manifest:
    """Return the manifest of a published version; raise CorruptFileError naming the file and the fix."""
    path = os.path.join(version_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = Manifest.from_json(json.loads(f.read()))
    except FileNotFoundError:
        raise CorruptFileError(f"{path} is missing; {_REPUBLISH}") from None
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise CorruptFileError(f"{path} is corrupt ({exc}); {_REPUBLISH}") from None
    expected = parse_version_dirname(os.path.basename(os.path.normpath(version_dir)))
    if manifest.version != expected:
        raise CorruptFileError(f"{path} says version {manifest.version} but lies in the directory of "
                               f"version {expected}; {_REPUBLISH}")
    return manifest


_REPUBLISH = ("the store's copy of this version is damaged: restore the file, or let the writer publish a new "
              "snapshot (restart it) and apply that")


def check_file(version_dir: str, name: str, size: int, expected: str, data=None) -> None:
    """Check a data file's size and digest (`data`: its bytes when already mapped); raise CorruptFileError."""
    path = os.path.join(version_dir, name)
    try:
        actual_size = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptFileError(f"{path} is missing; {_REPUBLISH}") from None
    if actual_size != size:
        how = "truncated" if actual_size < size else "longer than recorded"
        raise CorruptFileError(f"{path} is {how}: {actual_size} bytes, the manifest says {size}; {_REPUBLISH}")
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    if digest(data) != expected:
        raise CorruptFileError(f"{path} does not match its digest in {MANIFEST} (xxh3-128); {_REPUBLISH}")
