"""Disk-delta store: publish versions of the inference-format weights through shared storage as
deltas against a verified base, and apply them on inference hosts (issue 11).

`DeltaWriter` (trainer side) and `DeltaReader` (one per inference host) are the entry points;
`codec` holds the per-tensor encodings, `chain` the pure planning, `manifest` the on-disk format.
"""

from megatron_sync.transports.disk_delta.errors import (
    ChainError, CorruptFileError, DeltaError, LockHeldError, StoreWriteError, VersionNotPublishedError,
    WriterClosedError,
)
from megatron_sync.transports.disk_delta.options import WriterOptions
from megatron_sync.transports.disk_delta.reader import DeltaReader, StagedVersion
from megatron_sync.transports.disk_delta.writer import DeltaWriter

__all__ = [
    "DeltaWriter", "DeltaReader", "StagedVersion", "WriterOptions", "DeltaError", "CorruptFileError",
    "ChainError", "VersionNotPublishedError", "LockHeldError", "StoreWriteError", "WriterClosedError",
]
