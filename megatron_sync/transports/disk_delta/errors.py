"""Errors of the disk-delta store: each names the file or version at fault and the fix.

Every error derives from `DeltaError`, itself a `SyncError`, so a caller can
catch the family or every sync failure.
"""

from __future__ import annotations

from megatron_sync.core.errors import SyncError


class DeltaError(SyncError):
    """Base of every disk-delta store error; nothing was applied or published when it is raised."""


class CorruptFileError(DeltaError):
    """A stored file is missing, truncated, or its bytes do not match the manifest's digest."""


class ChainError(DeltaError):
    """A target version cannot be reached from the local copy: a gap, a wrong base, no snapshot."""


class VersionNotPublishedError(ChainError):
    """The requested version has no published directory (for example the writer died before rename)."""


class LockHeldError(DeltaError):
    """Another process holds the lock (a second applier on one host, or a second writer on one root)."""


class StoreWriteError(DeltaError):
    """Publishing a version failed (disk full, quota, file size limit, I/O error); nothing was published."""


class WriterClosedError(DeltaError):
    """The writer was closed, or its background thread stopped after an error."""
