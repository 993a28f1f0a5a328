"""Tier 2: the disk-delta writer and reader move versions through a directory, bit for bit.

Every check compares the reader's local copy (its memory-mapped views, and the
same file read back by the `safetensors` library) with the tensors submitted.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_sync.core.wait import poll
from megatron_sync.transports.disk_delta import DeltaReader, DeltaWriter, StoreWriteError, WriterOptions
from megatron_sync.transports.disk_delta.chain import Step
from megatron_sync.transports.disk_delta.localcopy import open_committed, read_slot, slot_path
from megatron_sync.transports.disk_delta.manifest import read_manifest
from megatron_sync.transports.disk_delta.storedir import gc_lock, published_versions, version_path
from tests.delta_support import assert_same_bytes, make_pair, publish, small_model, sparse_update
from tests.support.timing import scaled

pytestmark = pytest.mark.timeout(120)


def test_every_version_of_a_chain_arrives_bit_for_bit(tmp_path):
    writer, reader = make_pair(tmp_path)
    tensors = small_model()
    for version in range(1, 11):
        tensors = sparse_update(tensors, version) if version > 1 else tensors
        publish(writer, version, tensors)
        staged = reader.apply()
        assert staged.version == version == reader.version
        assert staged.plan.steps[0].part == ("snapshot" if version == 1 else "delta")
        assert_same_bytes(staged.tensors, tensors)
        assert_same_bytes(load_file(slot_path(str(tmp_path / "local"), staged.slot)), tensors)
    manifests = {v: read_manifest(version_path(str(tmp_path / "store"), v)) for v in published_versions(writer.root)}
    # snapshots at 1, 5, 9; retention 3 keeps 8..10 and 8's chain back to snapshot 5
    assert sorted(manifests) == [5, 6, 7, 8, 9, 10] and {v for v, m in manifests.items() if m.snapshot} == {5, 9}
    assert all(m.delta.base_version == v - 1 for v, m in manifests.items())
    delta = sum(writer.stats[-1].encodings.values())
    assert delta == writer.stats[-1].raw_bytes and writer.stats[-1].delta_bytes < 0.2 * delta
    writer.close(), reader.close()


def test_reapplying_the_held_version_is_a_no_op(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 1, small_model())
    staged = reader.apply(1)
    path = slot_path(str(tmp_path / "local"), staged.slot)
    before = (os.stat(path).st_mtime_ns, open(path, "rb").read())
    assert reader.apply(1) is None and reader.apply() is None
    assert (os.stat(path).st_mtime_ns, open(path, "rb").read()) == before
    writer.close(), reader.close()


def test_a_reader_catches_up_over_several_deltas_and_other_ranks_read_the_committed_copy(tmp_path):
    writer, reader = make_pair(tmp_path, snapshot_every=100)
    tensors = small_model()
    publish(writer, 1, tensors)
    reader.apply()
    for version in range(2, 6):
        tensors = sparse_update(tensors, version)
        publish(writer, version, tensors)
    staged = reader.apply()
    assert staged.plan.versions == (2, 3, 4, 5) and staged.plan.fallback_reason is None
    version, views = open_committed(str(tmp_path / "local"))
    assert version == 5
    assert_same_bytes(views, tensors)
    writer.close(), reader.close()


def test_stage_then_discard_keeps_the_committed_version(tmp_path):
    writer, reader = make_pair(tmp_path)
    first = small_model()
    publish(writer, 1, first)
    reader.apply()
    second = sparse_update(first, 2)
    publish(writer, 2, second)
    staged = reader.stage()
    assert_same_bytes(staged.tensors, second)
    assert_same_bytes(read_slot(staged.file), second)  # what the host's other ranks load
    assert_same_bytes(reader.tensors(), first)  # staged, not committed
    reader.discard(staged)
    assert reader.version == 1
    assert_same_bytes(reader.tensors(), first)
    assert_same_bytes(reader.apply().tensors, second)
    writer.close(), reader.close()


def test_garbage_collection_keeps_a_live_readers_chain_then_drops_it(tmp_path):
    writer, reader = make_pair(tmp_path, snapshot_every=4, retention=1)
    tensors = small_model()
    publish(writer, 1, tensors)
    reader.apply()
    reader.apply()
    publish(writer, 2, tensors := sparse_update(tensors, 2))
    reader.apply()
    for version in range(3, 9):
        publish(writer, version, tensors := sparse_update(tensors, version))
    assert published_versions(writer.root) == [3, 4, 5, 6, 7, 8]  # the reader at 2 still needs 3..8
    staged = reader.apply()
    assert staged.plan.versions == (3, 4, 5, 6, 7, 8)
    assert_same_bytes(staged.tensors, tensors)
    publish(writer, 9, tensors := sparse_update(tensors, 9))
    assert published_versions(writer.root) == [9]  # 9 carries a snapshot: retention 1 keeps it alone
    staged = reader.apply()
    assert staged.plan.steps == (Step(9, "delta"),)  # a snapshot version also carries a delta
    assert_same_bytes(staged.tensors, tensors)
    writer.close(), reader.close()


def test_a_reader_whose_deltas_were_collected_rebuilds_from_the_newest_snapshot(tmp_path):
    writer, reader = make_pair(tmp_path, snapshot_every=3, retention=1, lease_ttl_s=1e-9)  # leases expire at once
    tensors = small_model()
    publish(writer, 1, tensors)
    reader.apply()
    for version in range(2, 9):
        publish(writer, version, tensors := sparse_update(tensors, version))
    assert published_versions(writer.root) == [7, 8]
    staged = reader.apply()
    assert staged.plan.versions == (7, 8) and "gap" in staged.plan.fallback_reason
    assert_same_bytes(staged.tensors, tensors)
    writer.close(), reader.close()


def test_a_new_tensor_layout_is_published_as_a_snapshot(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 1, small_model())
    reader.apply()
    grown = {**small_model(), "lm_head.weight": torch.randn(250, 64).to(torch.bfloat16)}
    publish(writer, 2, grown)
    manifest = read_manifest(version_path(writer.root, 2))
    assert manifest.delta is None and manifest.snapshot is not None
    assert_same_bytes(reader.apply().tensors, grown)
    writer.close(), reader.close()


def test_submit_copies_the_tensors(tmp_path):
    writer, reader = make_pair(tmp_path)
    tensors = small_model()
    expected = {k: v.clone() for k, v in tensors.items()}
    writer.submit(1, tensors)
    for tensor in tensors.values():
        tensor.zero_()  # the trainer refills its replica right away
    writer.flush(timeout=60)
    assert_same_bytes(reader.apply().tensors, expected)
    writer.close(), reader.close()


def test_versions_only_increase(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 3, small_model())
    with pytest.raises(ValueError, match="must be greater than 3"):
        writer.submit(3, small_model())
    writer.close(), reader.close()


def _wait_until_published(root: str, versions: list[int], timeout: float = 30) -> None:
    """Wait until exactly `versions` are published in `root`, up to `timeout` (scaled for load)."""
    poll(lambda: published_versions(root) == versions, within=scaled(timeout),
         what=f"publication of exactly versions {versions} in {root}")


def test_when_behind_coalesce_publishes_the_newest_version_against_the_last_published(tmp_path):
    # Holding the store's gc lock parks the writer thread right after it published version 1
    # (garbage collection waits for the lock), so versions 2..4 arrive while it is busy.
    writer, reader = make_pair(tmp_path, when_behind="coalesce", queue_depth=1)
    versions = {1: small_model()}
    with gc_lock(writer.root):
        writer.submit(1, versions[1])
        _wait_until_published(writer.root, [1])  # the writer thread now waits for the lock
        for version in (2, 3, 4):
            versions[version] = sparse_update(versions[version - 1], version)
            writer.submit(version, versions[version])
    writer.flush(timeout=60)
    assert writer.skipped == [2, 3] and published_versions(writer.root) == [1, 4]
    assert read_manifest(version_path(writer.root, 4)).delta.base_version == 1
    reader.apply(1)
    assert_same_bytes(reader.apply().tensors, versions[4])
    writer.close(), reader.close()


def test_when_behind_block_waits_and_times_out(tmp_path):
    writer, reader = make_pair(tmp_path, when_behind="block", queue_depth=1, block_timeout_s=0.3)
    tensors = small_model()
    with gc_lock(writer.root):
        writer.submit(1, tensors)
        _wait_until_published(writer.root, [1])
        writer.submit(2, sparse_update(tensors, 2))  # waits in the queue
        with pytest.raises(TimeoutError, match="when_behind='block'"):
            writer.submit(3, sparse_update(tensors, 3))
    writer.submit(3, third := sparse_update(tensors, 3))
    writer.flush(timeout=60)
    assert writer.skipped == [] and published_versions(writer.root) == [1, 2, 3]
    assert_same_bytes(reader.apply().tensors, third)
    writer.close(), reader.close()


def test_manifest_records_versions_encodings_and_digests(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 1, tensors := small_model())
    publish(writer, 2, sparse_update(tensors, 2))
    with open(os.path.join(version_path(writer.root, 2), "manifest.json")) as f:
        obj = json.load(f)
    assert obj["version"] == 2 and obj["delta"]["base_version"] == 1 and obj["snapshot"] is None
    assert {name for name in obj["files"]} == set(os.listdir(version_path(writer.root, 2))) - {"manifest.json"}
    assert len(obj["tensors"]) == len(tensors) and all(len(t[3]) == 32 for t in obj["tensors"])  # xxh3-128 hex
    encodings = {c[0] for chunks in obj["delta"]["chunks"] for c in chunks}
    assert encodings <= {"raw", "sparse_xor", "plane_xor_zstd", "xor_zstd"} and "sparse_xor" in encodings
    writer.close(), reader.close()


def test_options_are_validated():
    for bad in (dict(snapshot_every=0), dict(retention=0), dict(encoding="lz4"), dict(when_behind="drop"),
                dict(zstd_level=0), dict(chunk_mb=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WriterOptions(**bad)


def test_a_restarted_writer_starts_with_a_snapshot_and_continues_the_numbering(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 1, tensors := small_model())
    reader.apply()
    writer.close()
    writer = DeltaWriter(writer.root, writer.options)
    with pytest.raises(ValueError, match="greater than 1"):
        writer.submit(1, tensors)
    publish(writer, 2, tensors := sparse_update(tensors, 2))
    assert read_manifest(version_path(writer.root, 2)).snapshot is not None
    assert_same_bytes(reader.apply().tensors, tensors)
    writer.close(), reader.close()


def test_reader_survives_a_restart_and_continues_from_its_committed_version(tmp_path):
    writer, reader = make_pair(tmp_path)
    publish(writer, 1, tensors := small_model())
    reader.apply()
    reader.close()
    publish(writer, 2, tensors := sparse_update(tensors, 2))
    reader = DeltaReader(writer.root, str(tmp_path / "local"), reader_id="host0")
    assert reader.version == 1
    staged = reader.apply()
    assert staged.plan.versions == (2,) and staged.plan.steps[0].part == "delta"
    assert_same_bytes(staged.tensors, tensors)
    writer.close(), reader.close()


def test_a_reading_lease_protects_versions_from_garbage_collection(tmp_path):
    from megatron_sync.transports.disk_delta.chain import Lease
    from megatron_sync.transports.disk_delta.storedir import write_lease

    writer, reader = make_pair(tmp_path, snapshot_every=3, retention=1)
    publish(writer, 1, tensors := small_model())
    publish(writer, 2, tensors := sparse_update(tensors, 2))
    write_lease(writer.root, Lease("slow-host", None, (1, 2)))  # a reader in the middle of reading 1 and 2
    for version in range(3, 8):
        publish(writer, version, tensors := sparse_update(tensors, version))
    assert published_versions(writer.root) == [1, 2, 7]  # 7 is a snapshot; 1, 2 are being read
    write_lease(writer.root, Lease("slow-host", None, ()))  # done reading
    publish(writer, 8, tensors := sparse_update(tensors, 8))
    assert published_versions(writer.root) == [7, 8]
    writer.close(), reader.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_are_published_exactly(tmp_path):
    writer, reader = make_pair(tmp_path)
    tensors = small_model()
    publish(writer, 1, {name: t.cuda() for name, t in tensors.items()})
    second = sparse_update(tensors, 2)
    publish(writer, 2, {name: t.cuda() for name, t in second.items()})
    reader.apply(1)
    assert_same_bytes(reader.apply(2).tensors, second)
    writer.close(), reader.close()


def test_on_published_hears_of_every_published_version_and_its_errors_are_reported(tmp_path):
    heard = []

    def tell_engines(stats):
        heard.append((stats.version, stats.delta_bytes > 0))
        if stats.version == 2:
            raise RuntimeError("control channel down")

    writer = DeltaWriter(str(tmp_path / "store"), WriterOptions(), on_published=tell_engines)
    publish(writer, 1, tensors := small_model())
    writer.submit(2, tensors := sparse_update(tensors, 2))
    with pytest.raises(StoreWriteError, match="control channel down"):
        writer.flush(timeout=60)
    publish(writer, 3, tensors := sparse_update(tensors, 3))  # the writer goes on; 2 stayed published
    assert heard == [(1, False), (2, True), (3, True)] and published_versions(writer.root) == [1, 2, 3]
    with DeltaReader(writer.root, str(tmp_path / "local"), reader_id="host0") as reader:
        assert_same_bytes(reader.apply().tensors, tensors)
    writer.close()


def test_a_buffer_filled_in_place_is_published_like_a_submitted_one(tmp_path):
    from megatron_sync.transports.disk_delta.publish import TensorLayout

    writer, reader = make_pair(tmp_path)
    tensors = small_model()
    layout = TensorLayout.of_specs((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    buffer = writer.reserve(layout)
    with pytest.raises(ValueError, match="the layout says"):  # a wrong dtype never lands in the buffer
        layout.fill_one(buffer, layout.entries[0], tensors[layout.entries[0].name].float())
    writer.release(buffer)  # e.g. the stream failed halfway: nothing is submitted
    buffer = writer.reserve(layout)
    for entry in reversed(layout.entries):  # in any order, as a stream yields them
        layout.fill_one(buffer, entry, tensors[entry.name])
    writer.submit_buffer(1, layout, buffer)
    writer.flush(timeout=60)
    assert_same_bytes(reader.apply().tensors, tensors)
    with pytest.raises(ValueError, match="version 1 must be greater than 1"):
        writer.submit_buffer(1, layout, writer.reserve(layout))
    writer.close(), reader.close()
