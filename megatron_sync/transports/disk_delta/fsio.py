"""File-system primitives of the delta store: durable writes, atomic publish, per-file locks.

Everything the store puts on disk goes through `write_all` (bytes) and
`write_json_atomic` (small state files), and a version becomes visible only
through `publish_dir`: fsync every file and the temporary directory, rename it
to its final name, fsync the parent. A reader therefore sees a version
complete or not at all, even after a crash at any point.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import uuid
from typing import Any, Optional

from megatron_sync.core.wait import WaitTimeout, poll
from megatron_sync.transports.disk_delta.errors import LockHeldError, StoreWriteError

_SPACE_ERRORS = {
    errno.ENOSPC: "the file system is full; free space on it or point the store at a larger one",
    errno.EDQUOT: "the disk quota is exhausted; raise the quota or free space",
    errno.EFBIG: "the file size limit (ulimit -f / RLIMIT_FSIZE) was reached; raise it",
}


def write_all(fd: int, data, path: str) -> int:
    """Write every byte of `data` (bytes-like) to `fd`; raise StoreWriteError naming `path` on failure."""
    view = memoryview(data).cast("B")
    done = 0
    try:
        while done < view.nbytes:
            done += os.write(fd, view[done:])
    except OSError as exc:
        fix = _SPACE_ERRORS.get(exc.errno, "check the storage and its mount")
        raise StoreWriteError(
            f"writing {path} failed after {done} of {view.nbytes} bytes ({exc.strerror}); {fix}. "
            "Nothing of this version was published"
        ) from exc
    return done


def fsync_path(path: str) -> None:
    """Flush a file's or directory's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    """Replace `path` with `obj` as JSON atomically: write a temporary file, fsync, rename, fsync the directory."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably: a temporary file, fsynced, renamed, and the directory
    fsynced. (Control messages, which need no durability, are written by `megatron_sync.session.files`.)"""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data, tmp)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """Make `tmp_dir` (whose files are already fsynced) visible as `final_dir` in one rename."""
    fsync_path(tmp_dir)
    if os.path.exists(final_dir):
        raise StoreWriteError(f"{final_dir} already exists; a version is published once, under a new number")
    os.rename(tmp_dir, final_dir)
    fsync_path(os.path.dirname(os.path.abspath(final_dir)))


def remove_dir(path: str, trash_prefix: str = ".trash-") -> None:
    """Delete a published directory: first rename it out of sight (atomic for readers), then remove it."""
    parent, name = os.path.split(os.path.abspath(path))
    trash = os.path.join(parent, f"{trash_prefix}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class FileLock:
    """An exclusive `flock` on one file, recording its holder (host, pid, what) inside for error messages."""

    def __init__(self, path: str, what: str, fix: str):
        self.path, self.what, self.fix = path, what, fix
        self._fd: Optional[int] = None

    def acquire(self, blocking: bool = False, wait_s: float = 0.0) -> "FileLock":
        """Take the lock (waiting up to `wait_s` for it, or without limit when `blocking`); raise LockHeldError
        naming the holder and the fix when another process keeps it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

        def taken() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                return False
            return True

        try:
            poll(taken, within=wait_s, what=f"the lock {self.path}")
        except WaitTimeout:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockHeldError(f"{self.what}: {self.path} is locked by {holder}; {self.fix}") from None
        record = f"host={socket.gethostname()} pid={os.getpid()}\n".encode()
        os.pwrite(fd, record, 0)  # written before truncating: the file never reads empty while held
        os.ftruncate(fd, len(record))
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        return self.acquire(blocking=True)

    def __exit__(self, *exc) -> None:
        self.release()


def lock_held(path: str) -> bool:
    """True when a process holds a `FileLock` on `path` (a look: a shared lock taken and dropped at once, so a
    process taking the lock then should wait a moment for it: `acquire(wait_s=...)`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _read_holder(fd: int, wait_s: float = 1.0) -> str:
    """Return the holder's record; a holder that has just taken the lock gets `wait_s` to write it."""
    def record() -> str:
        try:
            return os.pread(fd, 256, 0).decode(errors="replace").strip()
        except OSError:
            return ""

    try:
        return poll(record, within=wait_s, what="the lock holder's record")
    except WaitTimeout:
        return "another process"
