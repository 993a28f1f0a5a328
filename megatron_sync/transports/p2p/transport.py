"""P2P transport: every trainer rank sends its own share straight into the inference ranks that need it.

Membership: every trainer rank joins (the assignment may give any of them a share: its EP
rank's experts, or dense tensors spread over the TP/DP ranks of its stage), as transport
rank = its rank in the trainer job (torch.distributed's default group); the N inference
ranks come after them. Both jobs meet at the drivers' sync session (its join handshake);
the inference side, which knows only its own size, reads the trainer's from the session.

Bytes move with a `ByteMover` chosen by `weight_sync.p2p.backend`: "nixl" (NIXL agents over UCX write
from each trainer rank's registered arena into each receiver's registered window, device memory to device
memory where the NICs allow), "mooncake" (Mooncake Transfer Engine's one-sided writes; `p2p_protocol` tcp or
rdma) or "torch" (point-to-point on this transport's group, gloo or NCCL as `backend` says). Agreement and
control (sync v, stop, reports of rounds, window releases) run on the group and its store, as for
broadcast. The schedule (`schedule`, `build`, `balance`, `holders`), the start-up handshake, the sender
(`sender`, `walk`, `writer`) and the receiver (`receiver`, `rounds`) are in this package.

Failure: a rank that fails but lives (a conversion error, a corrupt range, a failed load)
makes every rank raise SyncAbortedError; the engines keep the previous version and the next
sync goes ahead. A rank that dies (or stalls past `timeout_s`) raises PeerFailureError on
the ranks that wait for it, and the others fail in the next agreement round, each within
`timeout_s`; the engines keep the previous version. A dead trainer rank ends the training
job itself, so the transport is not rebuilt in place: both jobs close it, and the relaunched
jobs rendezvous again.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_sync.transports.p2p.movers import ByteMover
from megatron_sync.transports.p2p.notices import receiver, trainer
from megatron_sync.transports.p2p.receiver import P2PReceiver
from megatron_sync.transports.p2p.sender import P2PSender
from megatron_sync.trainer.stream import MegatronWeightStream
from megatron_sync.transports.base import Commit, Receiver, Sender, Transport
from megatron_sync.session.control import StoreControlChannel
from megatron_sync.session.board import Board, store_board
from megatron_sync.session.group import TransportGroup, transport_group_over

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.plan.buckets import KeepTogether
    from megatron_sync.trainer.stream import HFWeightStream
    from megatron_sync.session.session import SyncSession

GROUP_NAME = "megatron_sync_p2p"


def _torch_mover(transport: "P2PTransport", config: "WeightSyncConfig") -> ByteMover:
    from megatron_sync.transports.p2p.movers.torch_p2p import TorchMover

    trainers = transport.num_trainer_ranks
    ranks = {trainer(s): s for s in range(trainers)}
    ranks.update({receiver(i): trainers + i for i in range(transport.world_size - trainers)})
    return TorchMover(transport.group, ranks)


def _mooncake_mover(transport: "P2PTransport", config: "WeightSyncConfig") -> ByteMover:
    from megatron_sync.transports.p2p.movers.mooncake import MooncakeMover

    return MooncakeMover(transport.group.board, hostname=config.p2p_local_hostname or socket.gethostname(),
                         protocol=config.p2p_protocol, device_name=config.p2p_device_name,
                         timeout_s=config.timeout_s, device=transport.group.device)


def _nixl_mover(transport: "P2PTransport", config: "WeightSyncConfig") -> ByteMover:
    from megatron_sync.transports.p2p.movers.nixl import NixlMover

    # trainer ranks only write: no progress thread beside training (see NixlMover)
    return NixlMover(transport.group.board, timeout_s=config.timeout_s, device=transport.group.device,
                     progress_thread=transport.group.rank >= transport.num_trainer_ranks,
                     wake_ms=config.p2p_nixl_wake_ms)


MOVERS: dict[str, Callable[["P2PTransport", "WeightSyncConfig"], ByteMover]] = {
    "nixl": _nixl_mover,
    "mooncake": _mooncake_mover,
    "torch": _torch_mover,
}
"""Byte movers by `weight_sync.p2p.backend`."""


TRAINER_RANKS_KEY = "trainer_ranks"


def _needs(session: Optional["SyncSession"]) -> "SyncSession":
    if session is None:
        raise ValueError("the p2p transport meets at the drivers' sync session: pass session= "
                         "(TrainerWeightSync / InferenceWeightSync do)")
    return session


def _sizes(session: "SyncSession", rank: int, timeout_s: float) -> Board:
    """Return the session's board for the group's sizes (keys under the session's own prefix)."""
    return store_board(session.store, prefix=f"{GROUP_NAME}/{session.id}/sizes/", rank=rank, timeout_s=timeout_s)


def _group(config: "WeightSyncConfig", session: "SyncSession", trainers: int, rank: int) -> TransportGroup:
    """Return the transport group of the trainer ranks and then the inference ranks, as `rank`."""
    return transport_group_over(session, trainers + config.num_inference_ranks, rank,
                                backend=config.resolved_backend(torch.cuda.is_available()),
                                timeout=config.timeout_s, group_name=GROUP_NAME)


def _trainer_rank_and_size(layout: "ParallelLayout") -> tuple[int, int]:
    """Return this process's rank and the trainer job's size (the default group, read here at the edge)."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    grid = layout.tp * layout.cp * layout.dp * layout.pp
    if grid != size:
        raise ValueError(
            f"transport 'p2p' joins every rank of the trainer job (torch.distributed's default group, "
            f"{size} ranks), but the parallel layout spans tp*cp*dp*pp={grid}; run the weight sync in the "
            "training job's own default group"
        )
    return rank, size


class P2PTransport(Transport):
    """One endpoint of the P2P transport: a trainer rank (any) or an inference rank."""

    name = "p2p"
    shares = ("checksum", "p2p_backend", "p2p_protocol")  # every piece is checked; one mover (and protocol)

    @classmethod
    def trainer_joins(cls, layout: "ParallelLayout") -> bool:
        """Every trainer rank joins: any of them may hold a share of the replica."""
        return True

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Optional["SyncSession"] = None) -> "P2PTransport":
        rank, trainers = _trainer_rank_and_size(layout)
        session = _needs(session)
        if rank == 0:  # the inference side learns the trainer's size here (it only knows its own)
            _sizes(session, rank, config.timeout_s).post(TRAINER_RANKS_KEY, str(trainers).encode())
        return cls(_group(config, session, trainers, rank), config, num_trainer_ranks=trainers)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int, inference_rank: int,
                          session: Optional["SyncSession"] = None) -> "P2PTransport":
        """Join as inference rank `inference_rank`; the trainer ranks (all join) come first."""
        session = _needs(session)
        trainers = int(_sizes(session, -1, config.timeout_s).fetch(TRAINER_RANKS_KEY))
        return cls(_group(config, session, trainers, trainers + inference_rank), config, num_trainer_ranks=trainers)

    def __init__(self, group: TransportGroup, config: "WeightSyncConfig", *, num_trainer_ranks: int) -> None:
        if not 0 < num_trainer_ranks < group.world_size:
            raise ValueError(f"num_trainer_ranks={num_trainer_ranks} must leave at least one inference rank "
                             f"in a group of {group.world_size}")
        self.group, self.num_trainer_ranks = group, num_trainer_ranks
        self.rank, self.world_size = group.rank, group.world_size
        self.control = StoreControlChannel(group.control_board())
        self.mover = MOVERS[config.p2p_backend](self, config)

    @property
    def inference_ranks(self) -> range:
        return range(self.num_trainer_ranks, self.world_size)

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self.group.all_gather_json(obj)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self.mover.alloc(nbytes)

    @classmethod
    def make_sender(cls, transport: Optional["Transport"], stream: "HFWeightStream",
                    config: "WeightSyncConfig", keep_together: "KeepTogether") -> Sender:
        """Return this trainer rank's P2P sender (collective: the start-up handshake).

        keep_together does not apply: every piece of every tensor is written by itself.
        """
        if not isinstance(stream, MegatronWeightStream):
            raise TypeError(f"transport 'p2p' gathers each rank's share from the Megatron chunks itself; it needs "
                            f"a MegatronWeightStream, got {type(stream).__name__}")
        if stream.group is not None and dist.get_world_size(stream.group) != transport.num_trainer_ranks:
            raise ValueError("transport 'p2p' runs on the trainer job's default group; pass trainer_group=None")
        return P2PSender.connect(transport, stream, config)

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional[Commit] = None) -> Receiver:
        """Return this inference rank's P2P receiver (collective: the start-up handshake)."""
        return P2PReceiver(self, engine, config, commit)

    def stop_transfers(self) -> None:
        self.group.close_backend()  # the torch mover's sends and receives; one-sided receivers wait on reports

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        self.group.close()
