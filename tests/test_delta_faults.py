"""Faults of the disk-delta transport: each is detected, nothing is applied, the error names the file and the fix.

"Nothing applied" is checked on real bytes: the reader's committed version and
its tensors (and the committed slot file on disk) are exactly what they were
before. Each fault test ends with a negative control or a recovery that shows
the same reader applying correctly once the fault is gone.

Processes: a writer killed between writing and renaming, two appliers racing,
and a disk that fills up mid-write run in spawned subprocesses with hard
timeouts (the project's harness, tests/support/dist.py). "Disk full" uses RLIMIT_FSIZE (unprivileged, so it runs in any CI):
the kernel itself cuts the write at the limit and then fails it with EFBIG,
through the writer's one write path, just as a full disk fails it with ENOSPC;
both take the same branch (`fsio.write_all`), which names each errno's fix.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal

import pytest
import torch

from megatron_sync.transports.disk_delta import (
    ChainError, CorruptFileError, DeltaReader, DeltaWriter, LockHeldError, StoreWriteError,
    VersionNotPublishedError, WriterOptions,
)
from megatron_sync.transports.disk_delta.chain import Step
from megatron_sync.transports.disk_delta.storedir import published_versions, snapshot_requests, version_path
from tests.delta_support import assert_same_bytes, make_pair, publish, small_model, sparse_update
from tests.support.dist import run_distributed, run_ranks

pytestmark = pytest.mark.timeout(120)
CHILD_TIMEOUT = 60


def _chain(tmp_path, count: int, seed: int = 0, **options):
    """Publish versions 1..count, apply up to version 2; return writer, reader and every version's tensors."""
    writer, reader = make_pair(tmp_path, **options)
    versions = {1: small_model(seed)}
    for version in range(1, count + 1):
        if version > 1:
            versions[version] = sparse_update(versions[version - 1], version + 100 * seed)
        publish(writer, version, versions[version])
        if version <= 2:
            reader.apply(version)
    return writer, reader, versions


class _Unchanged:
    """Records a reader's committed state; `check()` asserts it is byte for byte the same."""

    def __init__(self, reader: DeltaReader, expected: dict[str, torch.Tensor]):
        self.reader, self.expected, self.version = reader, expected, reader.version
        self.path = reader.committed_file
        self.file = open(self.path, "rb").read()

    def check(self) -> None:
        assert self.reader.version == self.version
        assert_same_bytes(self.reader.tensors(), self.expected)
        assert open(self.path, "rb").read() == self.file


def _data_file(root: str, version: int, part: str = "delta") -> str:
    return os.path.join(version_path(root, version), f"{part}-00000.bin")


# ----------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_damaged_data_file_is_detected_before_anything_is_applied(tmp_path, damage):
    writer, reader, versions = _chain(tmp_path, 4, snapshot_every=100)
    before = _Unchanged(reader, versions[2])
    path = _data_file(writer.root, 3)
    original = open(path, "rb").read()
    with open(path, "r+b") as f:
        if damage == "flip_byte":
            f.seek(len(original) // 2)
            f.write(bytes([original[len(original) // 2] ^ 0x10]))
        else:
            f.truncate(len(original) - 7)
    message = "does not match its digest" if damage == "flip_byte" else "is truncated"
    with pytest.raises(CorruptFileError, match=message) as info:
        reader.apply(4)
    assert path in str(info.value) and "publish a new snapshot" in str(info.value)
    before.check()
    with open(path, "wb") as f:  # negative control: the same store, repaired, applies
        f.write(original)
    assert_same_bytes(reader.apply(4).tensors, versions[4])
    writer.close(), reader.close()


def test_a_reader_that_meets_a_damaged_file_asks_for_a_snapshot_and_recovers_at_the_next_version(tmp_path):
    writer, reader, versions = _chain(tmp_path, 3, snapshot_every=100)
    before = _Unchanged(reader, versions[2])
    path = _data_file(writer.root, 3)
    with open(path, "r+b") as f:
        f.seek(5)
        f.write(b"\xff\xff")
    with pytest.raises(CorruptFileError, match="does not match its digest"):
        reader.apply(3)
    before.check()
    (request,) = snapshot_requests(writer.root)
    assert (request.reader, request.version) == ("host0", 3) and path in request.reason
    versions[4] = sparse_update(versions[3], 4)
    publish(writer, 4, versions[4])  # snapshot_every=100, yet the request makes version 4 carry a snapshot
    assert writer.stats[-1].snapshot_bytes > 0 and snapshot_requests(writer.root) == []
    staged = reader.apply(4)  # version 3 stays damaged: the plan goes around it
    assert staged.plan.steps == (Step(4, "snapshot"),)
    assert_same_bytes(staged.tensors, versions[4])
    versions[5] = sparse_update(versions[4], 5)
    publish(writer, 5, versions[5])
    assert writer.stats[-1].snapshot_bytes == 0  # one snapshot answered the request
    assert reader.apply(5).plan.steps == (Step(5, "delta"),)
    writer.close(), reader.close()


def test_damaged_manifest_is_detected(tmp_path):
    writer, reader, versions = _chain(tmp_path, 3, snapshot_every=100)
    before = _Unchanged(reader, versions[2])
    path = os.path.join(version_path(writer.root, 3), "manifest.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.replace('"base_version": 2', '"base_version": 1'))  # valid JSON, wrong content
    with pytest.raises(CorruptFileError, match="manifest_digest does not match") as info:
        reader.apply(3)
    assert path in str(info.value)
    before.check()
    writer.close(), reader.close()


def test_damaged_snapshot_is_detected_by_a_fresh_reader(tmp_path):
    writer, reader, versions = _chain(tmp_path, 1)
    with open(_data_file(writer.root, 1, "snapshot"), "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    fresh = DeltaReader(writer.root, str(tmp_path / "fresh"), reader_id="host1")
    with pytest.raises(CorruptFileError, match="snapshot-00000.bin does not match"):
        fresh.apply()
    assert fresh.version is None and fresh.tensors() == {}
    writer.close(), reader.close(), fresh.close()


# ----------------------------------------------------------------------------- wrong base, gaps


def test_local_copy_from_another_run_falls_back_to_the_snapshot(tmp_path):
    writer, reader, _ = _chain(tmp_path / "a", 2)  # the reader holds run A's version 2
    other, other_reader, versions = _chain(tmp_path / "b", 3, seed=1)  # run B: same numbers, other weights
    reader.close()
    reader = DeltaReader(other.root, str(tmp_path / "a" / "local"), reader_id="host0")
    staged = reader.apply(3)
    assert "base mismatch" in staged.plan.fallback_reason and staged.plan.steps[0].part == "snapshot"
    assert_same_bytes(staged.tensors, versions[3])
    for w in (writer, other):
        w.close()
    reader.close(), other_reader.close()


def test_delta_against_a_wrong_base_is_refused(tmp_path):
    writer, reader, versions = _chain(tmp_path / "a", 3, snapshot_every=100)
    other, other_reader, _ = _chain(tmp_path / "b", 3, seed=1, snapshot_every=100)
    before = _Unchanged(reader, versions[2])
    # Version 3 of run B (a delta against B's version 2) lands in run A's store: two runs mixed.
    shutil.rmtree(version_path(writer.root, 3))
    shutil.copytree(version_path(other.root, 3), version_path(writer.root, 3))
    with pytest.raises(ChainError, match="wrong base") as info:
        reader.apply(3)
    assert version_path(writer.root, 3) in str(info.value) and "own directory" in str(info.value)
    before.check()
    for w in (writer, other):
        w.close()
    reader.close(), other_reader.close()


def test_missing_version_without_a_later_snapshot_is_refused(tmp_path):
    writer, reader, versions = _chain(tmp_path, 5, snapshot_every=100)
    before = _Unchanged(reader, versions[2])
    shutil.rmtree(version_path(writer.root, 3))
    with pytest.raises(ChainError, match="is missing") as info:
        reader.apply(5)
    assert version_path(writer.root, 3) in str(info.value) and "publish a snapshot" in str(info.value)
    before.check()
    writer.close(), reader.close()


def test_missing_version_falls_back_to_the_newest_snapshot(tmp_path):
    writer, reader, versions = _chain(tmp_path, 6, snapshot_every=3, retention=10)  # snapshots: 1, 4
    shutil.rmtree(version_path(writer.root, 3))
    staged = reader.apply(6)
    assert staged.plan.versions == (4, 5, 6) and "gap" in staged.plan.fallback_reason
    assert_same_bytes(staged.tensors, versions[6])
    writer.close(), reader.close()


# ----------------------------------------------------------------------------- processes


def _writer_killed_before_rename(rank, root):
    from megatron_sync.transports.disk_delta import fsio

    writer = DeltaWriter(root, WriterOptions(snapshot_every=100))
    tensors = small_model()
    for version in (1, 2):
        tensors = sparse_update(tensors, version) if version > 1 else tensors
        publish(writer, version, tensors)
    fsio.publish_dir = lambda tmp, final: os.kill(os.getpid(), signal.SIGKILL)  # die at the rename
    writer.submit(3, sparse_update(tensors, 3))
    writer.flush(timeout=30)


@pytest.mark.multiproc
def test_writer_killed_between_write_and_rename_publishes_nothing(tmp_path):
    root = str(tmp_path / "store")
    outcome = run_ranks(_writer_killed_before_rename, 1, root, init_group=False, timeout=CHILD_TIMEOUT)
    assert outcome == {0: ("exited", -signal.SIGKILL)}
    leftovers = [n for n in os.listdir(root) if n.startswith(".tmp-v00000003-")]
    assert leftovers and "manifest.json" in os.listdir(os.path.join(root, leftovers[0]))  # written, not renamed
    assert published_versions(root) == [1, 2]
    reader = DeltaReader(root, str(tmp_path / "local"), reader_id="host0")
    assert reader.apply().version == 2  # the newest *published* version
    with pytest.raises(VersionNotPublishedError, match="unfinished write") as info:
        reader.apply(3)
    assert leftovers[0] in str(info.value)
    assert reader.version == 2
    writer = DeltaWriter(root, WriterOptions())  # a new writer removes the leftover, resumes with a snapshot
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    third = sparse_update(small_model(), 3)
    publish(writer, 3, third)
    staged = reader.apply(3)
    assert "without a delta part" in staged.plan.fallback_reason
    assert_same_bytes(staged.tensors, third)
    writer.close(), reader.close()


def _applier(rank, world_size, root, local):
    import torch.distributed as dist

    dist.barrier()  # both processes try at once
    try:
        reader = DeltaReader(root, local, reader_id=f"host-{rank}")
    except LockHeldError as exc:
        dist.barrier()
        return "refused", str(exc)
    staged = reader.apply()
    dist.barrier()  # hold the host's lock until the other applier has tried
    reader.close()
    return "applied", staged.version


@pytest.mark.multiproc
def test_two_appliers_racing_on_one_host_one_applies_the_other_is_refused(tmp_path):
    writer, first, versions = _chain(tmp_path, 3)
    first.close()
    local = str(tmp_path / "shared_local")
    outcome = run_distributed(_applier, 2, writer.root, local, timeout=CHILD_TIMEOUT)
    assert sorted(kind for kind, _ in outcome) == ["applied", "refused"]
    (_, applied), (_, message) = sorted(outcome)
    assert applied == 3
    assert os.path.join(local, "applier.lock") in message and "pid=" in message and "one DeltaReader per host" in message
    with DeltaReader(writer.root, local, reader_id="host0") as reader:  # the lock died with its holder
        assert reader.version == 3 and reader.apply() is None
        assert_same_bytes(reader.tensors(), versions[3])
    writer.close()


def _writer_with_file_size_limit(rank, root):
    writer = DeltaWriter(root, WriterOptions(snapshot_every=100))
    first = small_model()
    publish(writer, 1, first)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of killing the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, hard))  # the version-2 delta file is ~1 KB
    writer.submit(2, sparse_update(first, 2))
    try:
        writer.flush(timeout=30)
        failure = None
    except StoreWriteError as exc:
        failure = str(exc)
    after = published_versions(root), sorted(os.listdir(root))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
    publish(writer, 3, sparse_update(first, 3))
    writer.close()
    return failure, after, published_versions(root)


@pytest.mark.multiproc
def test_disk_full_mid_write_publishes_nothing_and_the_next_version_recovers(tmp_path):
    root = str(tmp_path / "store")
    (status, result), = run_ranks(_writer_with_file_size_limit, 1, root, init_group=False,
                                  timeout=CHILD_TIMEOUT).values()
    assert status == "ok", result
    failure, (published_after, listing_after), recovered = result
    assert failure is not None
    assert ".tmp-v00000002-" in failure and "delta-00000.bin" in failure and "file size limit" in failure
    written = int(failure.split("failed after ")[1].split(" of ")[0])
    assert 0 < written  # really mid-write: the kernel accepted part of the file
    assert published_after == [1] and not [n for n in listing_after if n.startswith(".tmp-")]
    assert recovered == [1, 3]
    reader = DeltaReader(root, str(tmp_path / "local"), reader_id="host0")
    staged = reader.apply()
    assert staged.version == 3
    assert_same_bytes(staged.tensors, sparse_update(small_model(), 3))
    reader.close()


_HOLDS_A_WRITER = """
import sys
from megatron_sync.transports.disk_delta.writer import DeltaWriter
writer = DeltaWriter(sys.argv[1])
print("writing", flush=True)
sys.stdin.read()  # keeps its writer until the test kills it
"""


@pytest.mark.multiproc
def test_readers_see_a_writer_that_died_as_gone_and_a_new_writer_still_starts(tmp_path):
    """A writer process holds its store; readers see it live. Killed (SIGKILL, nothing said), it is gone at
    once: the lock died with it. A new writer then takes the store."""
    import subprocess
    import sys

    from megatron_sync.transports.disk_delta.storedir import trainer_gone
    from megatron_sync.transports.disk_delta.writer import DeltaWriter

    root = str(tmp_path / "stage-0")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDS_A_WRITER, root], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "writing"
        live = trainer_gone([root])
        holder.kill()
        holder.wait(timeout=CHILD_TIMEOUT)
        dead = trainer_gone([root])
    finally:
        holder.kill()
    assert live is None
    assert dead is not None and f"no process holds {os.path.join(root, 'writer.lock')}" in dead, dead
    with DeltaWriter(root) as writer:
        assert trainer_gone([root]) is None and writer.last_version == 0
