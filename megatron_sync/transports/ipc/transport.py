"""Transport `ipc`: colocated trainer and engines hand buckets over in shared memory; only control crosses a socket.

For jobs whose trainer stage sources and inference ranks share one host (the
colocated RL setup: train, hand the weights over, generate, on the same
devices). Every trainer stage source owns one persistent segment
(`transport.segments`: a /dev/shm file on CPU, one CUDA IPC handle on GPU)
with two slots, created once per run when the plan is agreed; every
inference rank maps every stage's segment once. A sync then moves no weight
byte over a socket:

- the stage source converts its buckets into its host replica as with any
  bucket transport and hands bucket k over by copying it into slot k % 2 (on
  a worker thread, while the next bucket is produced and this one's checksum
  computed), then posts the bucket's header (version, index, bytes, checksum,
  slot) on the session's store;
- an inference rank reads the header, verifies the checksum over the slot's
  bytes and copies only its own regions (its engine's `rank_layout()`) into
  its staging set: one copy, of exactly its shard's bytes, with no receive
  buffer (`delivers_in_place`);
- a slot is reused only once every inference rank released it: asking for a
  stage's bucket k means being done with its bucket k - 2 (the bucket
  receiver holds at most two buckets), which the receiver posts; the stage
  source waits for all of them before overwriting that slot.

The plan handshake, the per-bucket checksums, the two commit rounds and the
session handshake are the same as every bucket transport's: agreement rounds
are all-gathers over the store (`BoardGather` over this board). The bytes each
rank moved through shared memory and through the store (keys and values of
every control message) are counted per sync in `SyncMetrics.media_bytes`.

Lifetime: a segment's name is unlinked as soon as every rank agreed it mapped
it, so nothing is left in /dev/shm whatever way the processes end; any rank
that fails before that unlinks the session's names itself. A peer that dies
while a rank waits for it is named within a second (`transport.liveness`: the
ranks share a host, so they watch each other's processes); `timeout_s` bounds
every wait. The transport runs over no process group, so `backend` only says
where the buffers live (nccl: GPU memory shared by CUDA IPC; gloo: host
shared memory).
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import BucketPlan, SyncPlan
from megatron_sync.transports.base import BucketHeader, PendingBucket, Receiver, Sender, Transport
from megatron_sync.transports.buckets.transport import PlanBucketTransport
from megatron_sync.session.control import StoreControlChannel
from megatron_sync.session.board import Board, BoardGather, WaitingStore, store_board, waiting_board
from megatron_sync.session.liveness import PeerWatch, ProcessId
from megatron_sync.transports.ipc.segments import (
    SLOTS, CudaSegment, HostSegment, Segment, SegmentInfo, segment_name, slot_bytes_for, unlink_session_segments,
)

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.plan.buckets import KeepTogether
    from megatron_sync.trainer.stream import HFWeightStream
    from megatron_sync.transports.base import Commit
    from megatron_sync.session.session import SyncSession


class IpcTransport(PlanBucketTransport):
    """Stage sources and inference ranks of one host, buckets through one shared segment per stage source."""

    name = "ipc"
    delivers_in_place = True
    max_buckets_in_flight = SLOTS

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Optional["SyncSession"] = None) -> "IpcTransport":
        return cls(config, session, rank=layout.pp_rank, num_stages=layout.pp)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int, inference_rank: int,
                          session: Optional["SyncSession"] = None) -> "IpcTransport":
        return cls(config, session, rank=num_trainer_stages + inference_rank, num_stages=num_trainer_stages)

    def __init__(self, config: "WeightSyncConfig", session: Optional["SyncSession"], *, rank: int,
                 num_stages: int) -> None:
        if session is None:
            raise ValueError("the ipc transport meets at the drivers' sync session: pass session= "
                             "(TrainerWeightSync / InferenceWeightSync do)")
        self.rank, self.num_stages = rank, num_stages
        self.world_size = num_stages + config.num_inference_ranks
        self.session_id, self.timeout_s = session.id, config.timeout_s
        on_gpu = config.resolved_backend(torch.cuda.is_available()) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.media = {"shm": 0, "socket": 0}  # counted by this endpoint's calling thread
        self._worker_media = {"shm": 0, "socket": 0}  # counted by a source's worker thread
        prefix = f"ipc/{session.id}/"
        # Control messages post on the session's own connection and wait in the store's wait, a bounded slice at
        # a time (an idle engine waits there for hours, and a stopped trainer must be noticed); the data path and
        # the agreement rounds wait on connections of their own (`board.WaitingStore`).
        self._control_board = store_board(session.store, prefix=prefix, rank=rank, blocking=True,
                                          timeout_s=config.timeout_s, failure=self._fail, media=self.media)
        self.control = StoreControlChannel(self._control_board)
        self._store = session.store.raw  # each thread's board waits on a connection of its own (`clone`)
        self.board = self._board_for_this_thread()
        self._gather = BoardGather(self.board, name="all", index=rank, size=self.world_size)
        self.segments: dict[int, Segment] = {}  # stage -> its segment (a source: its own)
        self._sent = 0  # own buckets handed over so far (the next one's sequence number)
        self._asked = [0] * num_stages  # per stage, buckets this inference rank asked for so far
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._worker_board: Optional[Board] = None
        self._watch: Optional[PeerWatch] = None
        self.board.post(f"process/{rank}", ProcessId.mine().to_bytes())

    def _board_for_this_thread(self, media: Optional[dict[str, int]] = None) -> Board:
        return waiting_board(self._store.clone(), prefix=f"ipc/{self.session_id}/", rank=self.rank,
                             timeout_s=self.timeout_s, media=self.media if media is None else media, failure=self._fail)

    def _fail(self, op: str, error: BaseException) -> PeerFailureError:
        return PeerFailureError(f"[transport rank {self.rank}] {op} on the ipc transport's store failed or timed out "
                                f"(timeout {self.timeout_s:g}s): {error}")

    @property
    def device(self) -> torch.device:
        return self._device

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self._gather(obj)

    def take_media_bytes(self) -> dict[str, int]:
        """Return (and reset) the bytes moved through shared memory and over the store since the last call."""
        taken = {key: self.media[key] + self._worker_media[key] for key in self.media}
        for counts in (self.media, self._worker_media):
            for key in counts:
                counts[key] = 0
        return taken

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return every stage's metadata; each stage source posts its own list."""
        if stage_metas is not None:
            self.board.post(f"meta/{self.rank}", json.dumps([list(m.to_wire()) for m in stage_metas]).encode())
        return [[TensorMeta.from_wire((n, tuple(s), d)) for n, s, d in json.loads(self.board.fetch(f"meta/{stage}"))]
                for stage in range(self.num_stages)]

    # ---- the segments (once per run, after the plan is agreed) ----

    def open_segments(self, plan: SyncPlan) -> None:
        """Create this source's segment or map every stage's (inference ranks); collective over the transport.

        Every rank then agrees it holds what it needs, and each source unlinks its segment's name: from
        here on the segment lives exactly as long as the processes that mapped it.
        """
        error = None
        try:
            if self.is_source:
                self._create_own(plan)
            elif self.rank in self.inference_ranks:
                for stage in range(self.num_stages):
                    info = SegmentInfo.from_bytes(self.board.fetch(f"segment/{stage}"))
                    if info.kind == "error":
                        raise RuntimeError(f"trainer stage {stage} could not create its segment: {info.name}")
                    self.segments[stage] = (CudaSegment.attach(info) if info.kind == "cuda"
                                            else HostSegment.attach(info))
            peers = {r: ProcessId.from_bytes(self.board.fetch(f"process/{r}")) for r in range(self.world_size)}
        except PeerFailureError:
            self._unlink_all()
            raise
        except Exception as e:  # noqa: BLE001 — agreed on below, so every rank fails alike
            error = f"{type(e).__name__}: {e}"
        try:
            self.agree(error, what="mapping the ipc transport's shared segments")
        finally:
            self._unlink_all()
        self._watch = PeerWatch(self._store.clone(), peers)
        for board in (self.board, self._worker_board):
            if board is not None and isinstance(board.medium, WaitingStore):
                board.medium.watch = self._watch

    def _create_own(self, plan: SyncPlan) -> None:
        own = [b.nbytes for b in plan.buckets if b.stage == self.rank]
        token = secrets.token_hex(16)
        name = segment_name(self.session_id, self.rank, token)
        slot_bytes = slot_bytes_for(max(own, default=1))
        try:
            segment = (CudaSegment.create(name, self.rank, slot_bytes, token, self.device) if self.device.type == "cuda"
                       else HostSegment.create(name, self.rank, slot_bytes, token))
        except Exception as e:
            self.board.post(f"segment/{self.rank}", SegmentInfo("error", f"{type(e).__name__}: {e}", self.rank, 0,
                                                                 token, socket.gethostname()).to_bytes())
            raise
        self.segments[self.rank] = segment
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatron-sync-ipc")
        self._worker_board = self._board_for_this_thread(self._worker_media)  # its own counters: no shared +=
        self.board.post(f"segment/{self.rank}", segment.info.to_bytes())

    def _unlink_all(self) -> None:
        """Remove this session's segment names from /dev/shm (the creator's, or left by a failed one)."""
        for segment in self.segments.values():
            segment.unlink()
        if self.device.type == "cpu":
            unlink_session_segments(self.session_id)

    # ---- moving buckets ----

    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor, seal: Callable[[], BucketHeader]) -> "_Handover":
        """Copy the bucket into its slot on the worker thread (after every receiver released the slot's
        previous bucket), compute `seal()`'s checksum meanwhile, then post the header."""
        assert bucket.stage == self.rank and self._worker is not None, (bucket.stage, self.rank)
        sequence, self._sent = self._sent, self._sent + 1
        header: concurrent.futures.Future = concurrent.futures.Future()
        done = self._worker.submit(self._hand_over, sequence, bucket, data, header)
        try:
            header.set_result(seal())
        except BaseException as e:
            header.set_exception(e)
            raise
        return _Handover(done)

    def _hand_over(self, sequence: int, bucket: BucketPlan, data: torch.Tensor,
                   header: concurrent.futures.Future) -> float:
        stage, slot = self.rank, sequence % SLOTS
        if sequence >= SLOTS:  # the slot's previous bucket: every inference rank must be done with it
            previous = sequence - SLOTS
            board = self._worker_board
            for rank in self.inference_ranks:
                board.fetch(f"released/{stage}/{previous}/{rank}")
            for rank in self.inference_ranks:
                board.remove(f"released/{stage}/{previous}/{rank}")
            board.remove(f"bucket/{stage}/{previous}")
        target = self.segments[stage].slot(slot)
        if data.device.type == "cuda" or self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bucket is complete on the producing stream
        target[: bucket.nbytes].copy_(data[: bucket.nbytes])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bytes are in place before anyone is told
        self._worker_media["shm"] += bucket.nbytes
        sealed: BucketHeader = header.result()
        self._worker_board.post(f"bucket/{stage}/{sequence}", json.dumps(
            [sealed.version, sealed.index, sealed.nbytes, sealed.checksum, slot]).encode())
        return time.perf_counter()

    def recv_bucket(self, bucket: BucketPlan, out: Optional[torch.Tensor]) -> PendingBucket:
        """Start receiving `bucket`: release the slot's previous bucket of that stage, return the pending read."""
        if self.rank not in self.inference_ranks:
            return _NotForThisRank(bucket)  # stage sources take no part in other stages' hand-overs
        stage = bucket.stage
        sequence, self._asked[stage] = self._asked[stage], self._asked[stage] + 1
        if sequence >= SLOTS:
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the copies out of the previous bucket are done
            self.board.post(f"released/{stage}/{sequence - SLOTS}/{self.rank}", b"")
        return _SlotRead(self, bucket, sequence)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._unlink_all()
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()
        if self._watch is not None:
            self._watch.close()
        self.board.close()
        self._control_board.close()  # the connections its blocking waits held
        if self._worker_board is not None:
            self._worker_board.close()

    # ---- the halves of a sync ----

    @classmethod
    def make_sender(cls, transport: Optional[Transport], stream: "HFWeightStream", config: "WeightSyncConfig",
                    keep_together: "KeepTogether") -> Sender:
        sender = super().make_sender(transport, stream, config, keep_together)
        if transport is not None:
            assert isinstance(transport, IpcTransport), transport
            transport.open_segments(sender.plan)
        return sender

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional["Commit"] = None) -> Receiver:
        receiver = super().make_receiver(engine, config, keep_together, commit)
        self.open_segments(receiver.plan)
        return receiver


class _Handover:
    """One bucket being copied into its slot and announced (the worker thread's job)."""

    def __init__(self, done: concurrent.futures.Future) -> None:
        self._done = done

    @property
    def done_at(self) -> Optional[float]:
        return self._done.result() if self._done.done() and self._done.exception() is None else None

    def wait(self) -> None:
        self._done.result()  # every step inside is bounded by timeout_s

    def is_completed(self) -> bool:
        return self._done.done()


class _SlotRead(PendingBucket):
    """A bucket an inference rank reads where it lies: in its stage's segment."""

    def __init__(self, transport: IpcTransport, bucket: BucketPlan, sequence: int) -> None:
        self._transport, self._bucket, self._sequence = transport, bucket, sequence
        self._result: Optional[tuple[BucketHeader, torch.Tensor]] = None
        self._done_at: Optional[float] = None

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        if self._result is None:
            t, stage = self._transport, self._bucket.stage
            version, index, nbytes, value, slot = json.loads(t.board.fetch(f"bucket/{stage}/{self._sequence}"))
            t.media["shm"] += self._bucket.nbytes
            self._result = BucketHeader(version, index, nbytes, value), t.segments[stage].slot(slot)
            self._done_at = time.perf_counter()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None

    @property
    def done_at(self) -> Optional[float]:
        return self._done_at


class _NotForThisRank(PendingBucket):
    """Another stage's bucket on a stage source: nothing arrives here (the relay ignores the result)."""

    def __init__(self, bucket: BucketPlan) -> None:
        self._bucket = bucket

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        return BucketHeader(0, self._bucket.index, 0, 0), torch.empty(0, dtype=torch.uint8)

    def is_completed(self) -> bool:
        return True
