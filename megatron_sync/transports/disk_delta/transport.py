"""Disk-delta transport: versions travel through shared storage as deltas against a verified base.

For deployments where the trainer and the engines share a file system but no
fast network (or no network path at all). Everything goes through
`weight_sync.disk_delta.dir`:

    <delta_dir>/stage-<s>/   stage s's store: one directory per published version (megatron_sync.transports.disk_delta)
    <delta_dir>/control/     the directory session and its control files (megatron_sync.session.files)

Trainer: each stage source runs a `DeltaWriter` on its stage's store; `sync(v)`
converts the stage straight into a writer buffer and returns (the writer
encodes and publishes it off the training path, see `megatron_sync.transports.disk_delta.sender`).
Inference: on each host one rank applies every stage's versions to the host's
local copy under `weight_sync.disk_delta.local_dir`; every rank loads its shards
from it (see `megatron_sync.transports.disk_delta.receiver`).

Control needs no network either. The leader's control channel is the usual
`StoreControlChannel`, over a board of files in delta_dir/control (`session.files.Directory`)
instead of a TCP store; the inference ranks' agreement rounds are an
all-gather over files too. The trainer and the engines never agree with each
other during a sync: the trainer does not wait for the engines, so the
inference side's all-gather spans the inference ranks only (and the trainer
side has none: each stage source publishes on its own; the trainer's own
group agrees on sync failures, as for every transport).

Versions: the store's version numbers only increase across runs. A trainer
that starts on a store whose newest version is n publishes its k-th sync as
version n + k (`version_offset` = n, announced in the session), so engines
hold, and generation records, the store's numbers; they equal the driver's
sync counts on a fresh store.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from megatron_sync.transports.disk_delta.options import writer_options
from megatron_sync.transports.disk_delta.publish import PublishStats
from megatron_sync.transports.disk_delta.receiver import DeltaReceiver
from megatron_sync.transports.disk_delta.sender import DeltaSender
from megatron_sync.transports.disk_delta.storedir import published_versions, trainer_gone
from megatron_sync.transports.disk_delta.writer import DeltaWriter
from megatron_sync.transports.base import Commit, Transport
from megatron_sync.session.control import ControlChannel, StoreControlChannel
from megatron_sync.session.board import Board, BoardGather
from megatron_sync.session.files import FileRendezvous, directory_board, liveness_check, presenting
from megatron_sync.session.rendezvous import Identity, expectations
from megatron_sync.session.secret import SessionSecret

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.plan.buckets import KeepTogether
    from megatron_sync.trainer.stream import HFWeightStream

log = logging.getLogger("megatron_sync")


def stage_store(delta_dir: str, stage: int) -> str:
    """Return the store directory of pipeline stage `stage`."""
    return os.path.join(delta_dir, f"stage-{stage}")


def control_dir(delta_dir: str) -> str:
    """Return the directory of the control session."""
    return os.path.join(delta_dir, "control")


def latest_version(delta_dir: str) -> int:
    """Return the newest version published in any stage's store (0 for a new store)."""
    names = os.listdir(delta_dir) if os.path.isdir(delta_dir) else []
    return max((max(published_versions(os.path.join(delta_dir, n)), default=0)
                for n in names if n.startswith("stage-")), default=0)


def _presentation(config: "WeightSyncConfig", role: str, member: int, *,
                  trainer_stages: Optional[int]) -> FileRendezvous:
    """What a rank presents at the directory session when its driver gave nothing: its settings (no model
    fields: the drivers add them from the HF config) and the session secret of its environment."""
    expects = expectations(config, trainer_stages=trainer_stages, backend="", shares=DiskDeltaTransport.shares)
    return presenting(Identity(job="", role=role, member=member, expects=expects, session=config.run_id),
                      timeout_s=config.timeout_s, secret=SessionSecret.from_environment())


class _LeaderOnly(ControlChannel):
    """The control channel of a stage source that is not the leader: only the leader talks to the engines."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("only the leader (stage 0's source) talks to the engines over the disk-delta session")

    send = next = report = collect = _refuse


class DiskDeltaTransport(Transport):
    """One endpoint: a stage source (a writer) or an inference rank (a reader on its host's applier)."""

    name = "disk_delta"
    meets_at_store = False  # the jobs meet through files in delta_dir/control (no network between them)
    meets_in_files = True  # ... in a directory session (`session.files`): the drivers pass a `FileRendezvous`

    def __init__(self, config: "WeightSyncConfig", *, rank: int, num_stages: int, control: ControlChannel,
                 version_offset: int, gather: Optional[BoardGather] = None,
                 board: Optional[Board] = None, writer: Optional["DeltaWriter"] = None) -> None:
        self.config, self.rank, self.num_stages = config, rank, num_stages
        self.world_size = num_stages + config.num_inference_ranks
        self.control, self.version_offset = control, version_offset
        self.writer, self._gather, self._board = writer, gather, board
        self._sender: Optional["DeltaSender"] = None
        self._receiver: Optional["DeltaReceiver"] = None

    # ---- connecting

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Optional[FileRendezvous] = None) -> "DiskDeltaTransport":
        """Stage `layout.pp_rank`'s source: its writer, and on stage 0 the directory session it hosts (as
        `session`, the drivers' presentation of the trainer; one built from `config` when None)."""
        # Every stage source reads the same number: no writer of this run has published yet.
        transport = cls(config, rank=layout.pp_rank, num_stages=layout.pp, control=_LeaderOnly(),
                        version_offset=latest_version(config.delta_dir))
        transport.writer = DeltaWriter(stage_store(config.delta_dir, layout.pp_rank), writer_options(config),
                                       on_published=transport._published)
        try:
            if layout.pp_rank == 0:  # after taking stage 0's writer lock: this is the directory's only trainer
                rendezvous = session or _presentation(config, "trainer", 0, trainer_stages=layout.pp)
                opened = rendezvous.host(control_dir(config.delta_dir),
                                         members={"trainer": 1, "inference": config.num_inference_ranks},
                                         details={"version_offset": transport.version_offset})
                board = directory_board(opened.folder, rank=0, timeout_s=config.timeout_s)
                transport.control = StoreControlChannel(board)
        except BaseException:
            transport.close()
            raise
        return transport

    def _published(self, stats: PublishStats) -> None:
        """The writer's hook (its own thread): the sender records the publication."""
        if self._sender is not None:
            self._sender.on_published(stats)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: Optional[int],
                          inference_rank: int, session: Optional[FileRendezvous] = None) -> "DiskDeltaTransport":
        """Inference rank `inference_rank`, admitted to the trainer's directory session (presenting `session`, or
        an identity built from `config` when None); `num_trainer_stages` None takes the trainer's."""
        rendezvous = session or _presentation(config, "inference", inference_rank, trainer_stages=num_trainer_stages)
        opened = rendezvous.join(control_dir(config.delta_dir))
        stages = int(opened.host.expects["trainer_stages"])
        rank = stages + inference_rank
        stores = [stage_store(config.delta_dir, s) for s in range(stages)]
        board = directory_board(opened.folder, rank=rank, timeout_s=config.timeout_s,
                                alive=liveness_check(opened, lambda: trainer_gone(stores)))
        gather = BoardGather(board, name="inference", index=inference_rank, size=config.num_inference_ranks)
        return cls(config, rank=rank, num_stages=stages, control=StoreControlChannel(board),
                   version_offset=int(opened.details["version_offset"]), gather=gather, board=board)

    # ---- the interface

    @property
    def inference_ranks(self) -> range:
        return range(self.num_stages, self.world_size)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every inference rank's `obj`, by inference rank (inference endpoints only: the trainer
        never gathers with the engines, nor its stage sources with each other, in this transport)."""
        if self._gather is None:
            raise RuntimeError("disk-delta trainer endpoints do not gather: each stage source publishes on its own "
                               "(the trainer's own process group agrees on sync failures)")
        return self._gather(obj)

    @classmethod
    def make_sender(cls, transport: Optional["Transport"], stream: "HFWeightStream", config: "WeightSyncConfig",
                    keep_together: "KeepTogether") -> "DeltaSender":
        if transport is None:
            return DeltaSender(stream, None, version_offset=0)
        assert isinstance(transport, DiskDeltaTransport), transport
        transport._sender = DeltaSender(stream, transport.writer, version_offset=transport.version_offset,
                                        rank=transport.rank, metrics_path=config.metrics_path)
        return transport._sender

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional[Commit] = None) -> "DeltaReceiver":
        # keep_together needs nothing here: a version is applied whole or not at all.
        self._receiver = DeltaReceiver(
            engine, stores=[stage_store(config.delta_dir, s) for s in range(self.num_stages)],
            local_dir=config.delta_local_dir, gather=self.all_gather_json, index=self.rank - self.num_stages,
            rank=self.rank, version_offset=self.version_offset, timeout_s=config.timeout_s, commit=commit,
            metrics_path=config.metrics_path)
        return self._receiver

    def close(self) -> None:
        """Publish what the writer still holds (trainer), release the local copies (inference)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close(timeout=self.config.timeout_s)
            except Exception:  # noqa: BLE001 — closing after a failure must not mask it
                log.error("[transport rank %d] the delta writer did not publish its last version(s) cleanly",
                          self.rank, exc_info=True)
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._board is not None:
            self._board.close()
