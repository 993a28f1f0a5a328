"""Settings of the delta writer: one keyword-only dataclass, validated on creation."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_sync.transports.disk_delta.codec import CHOICES, DEFAULT_LEVEL

WHEN_BEHIND = ("coalesce", "block")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How the writer encodes, publishes and garbage-collects versions."""

    snapshot_every: int = 10
    """Every N-th published version also carries a full snapshot (the first one always does)."""

    retention: int = 4
    """Keep the newest N versions (each with its chain back to a snapshot) plus what live readers need."""

    encoding: str = "auto"
    """Per-chunk encoding policy: "auto" (cheap heuristic), "best" (try all, keep the smallest), or one
    encoding name (see megatron_sync.transports.disk_delta.codec.CODECS). Raw bytes are kept whenever nothing is smaller."""

    zstd_level: int = DEFAULT_LEVEL
    """zstd compression level (1 is fastest; higher levels gain little on XOR data)."""

    chunk_mb: float = 64.0
    """Tensors are encoded in chunks of this many MiB: the unit of parallelism, and of scratch memory
    (each encode thread keeps two scratch buffers of this size; the reader two for decoding)."""

    file_mb: float = 1024.0
    """A version's data files are cut at this size (a larger single chunk gets its own file)."""

    encode_threads: int = 2
    """Threads that encode chunks in parallel (zstd and numpy release the GIL)."""

    queue_depth: int = 1
    """Versions that may wait for the encoder. Host memory: (queue_depth + 2) copies of the replica."""

    when_behind: str = "coalesce"
    """When a version is submitted while the queue is full: "coalesce" replaces the newest waiting
    version with it (the waiting one is never published; training never waits), "block" makes
    submit wait until the encoder takes a version (every version is published)."""

    block_timeout_s: float = 600.0
    """With when_behind="block", how long submit may wait before raising TimeoutError."""

    lease_ttl_s: float = 3600.0
    """A reader lease not refreshed for this long no longer protects versions from garbage collection."""

    def __post_init__(self) -> None:
        for name in ("snapshot_every", "retention", "encode_threads", "queue_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("chunk_mb", "file_mb", "block_timeout_s", "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.encoding not in CHOICES:
            raise ValueError(f"encoding must be one of {list(CHOICES)}, got {self.encoding!r}")
        if self.when_behind not in WHEN_BEHIND:
            raise ValueError(f"when_behind must be one of {list(WHEN_BEHIND)}, got {self.when_behind!r}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in 1..22, got {self.zstd_level}")

    @property
    def chunk_bytes(self) -> int:
        """Chunk size in bytes, a multiple of 8 so a chunk never splits an element."""
        return max(8, int(self.chunk_mb * 2**20) // 8 * 8)

    @property
    def file_bytes(self) -> int:
        """Data file size limit in bytes."""
        return max(1, int(self.file_mb * 2**20))


def writer_options(config: Any) -> WriterOptions:
    """Return the disk-delta writer's options from the weight-sync settings (ValueError names the field)."""
    try:
        return WriterOptions(snapshot_every=config.delta_snapshot_every, retention=config.delta_retention,
                             encoding=config.delta_encoding, when_behind=config.delta_when_behind,
                             queue_depth=config.delta_queue_depth, encode_threads=config.delta_encode_threads,
                             block_timeout_s=config.timeout_s)
    except ValueError as e:
        raise ValueError(f"delta_{e}") from None
