"""The two halves of a P2P sync: each trainer rank sends its share, each inference rank receives its shards.

Sender (every trainer rank): refresh this rank's share of the distributed replica (gather
and convert only its assigned tensors), write each planned range straight into the staging
memory of the inference ranks that need it, then take part in the two agreement rounds.
All trainer ranks send at once; each receiver hears from every holder of its tensors.

Both take the endpoint of `megatron_sync.transports.p2p.transport` (a `Transport` with `num_trainer_ranks`, `group`
and a byte `mover`), which builds them.

Receiver (every inference rank): two staging sets of exactly this rank's params (its layout's
params back to back, `megatron_sync.layout.staging`), allocated and exposed once; a version is
received into the set the engine does not run from (both sides flip sets after every version
all ranks committed, so the senders know where to write), every range's checksum verified,
then the two rounds of `transport/commit.py`: "all intact" -> commit the staged params (typed
views into the set) -> "all loaded", rolling back from the other set if another rank failed. A sender that fails tells its receivers (every rank then aborts the version together,
and the next sync goes ahead); a sender that dies raises PeerFailureError on the ranks
waiting for it, and the transport must be rebuilt (see `megatron_sync/transports/p2p/transport.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.layout.staging import StagingSets
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.transports.p2p.execute import fail_share, receive_shards, send_share
from megatron_sync.transports.p2p.handshake import PlanInputs, handshake
from megatron_sync.transports.p2p.plan import TransferPlan, send_bytes_per_tensor
from megatron_sync.transports.p2p.replica import DistributedReplica
from megatron_sync.transports.base import Commit, Receiver, Sender, Transport
from megatron_sync.session.commit import AgreedCommit, sender_rounds

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.trainer.stream import MegatronWeightStream

log = logging.getLogger("megatron_sync")
MiB = 2**20


class P2PSender(Sender):
    """The trainer half on one trainer rank (transport rank == its global trainer rank)."""

    def __init__(self, transport: "Transport", replica: DistributedReplica, plan: TransferPlan, *,
                 checksum: str, metrics_path: Optional[str] = None) -> None:
        self.transport, self.replica, self.plan = transport, replica, plan
        self.checksum = checksum
        self.metrics_path = metrics_path
        self.history: list[SyncMetrics] = []
        self.messages = len(plan.sender_queue(transport.rank))
        self._attempt = 0  # syncs so far; trainer and engines count them in step
        self._target = 0  # the staging set every receiver takes the next version into (StagingSets.target)

    def sent_tensors(self) -> dict[str, torch.Tensor]:
        """Return this rank's share of the distributed replica by HF name."""
        return dict(self.replica.tensors)

    @classmethod
    def connect(cls, transport: "Transport", stream: "MegatronWeightStream",
                config: "WeightSyncConfig") -> "P2PSender":
        """Return the sender after the start-up handshake (collective over the trainer job and the transport)."""
        specs = stream.converter.tensor_specs()
        built: list[DistributedReplica] = []

        def build_replica(layouts) -> Optional[PlanInputs]:
            cost = send_bytes_per_tensor(specs, layouts)
            replica = DistributedReplica(stream, rank=transport.rank, cost=cost,
                                         gather_budget_bytes=int(config.gather_budget_mb * MiB))
            built.append(replica)
            if transport.rank != 0:
                return None
            log.info("[trainer rank 0] P2P replica assignment (bytes each rank converts and holds):\n%s",
                     replica.assignment.report())
            return PlanInputs(specs, replica.assignment.hf_holders())

        plan = handshake(transport, num_trainer_ranks=transport.num_trainer_ranks,
                         engine_tp_size=config.engine_tp_size, bucket_bytes=config.bucket_size_bytes,
                         replica=build_replica)
        return cls(transport, built[0], plan, checksum=resolve_checksum(config.checksum, transport.mover.device),
                   metrics_path=config.metrics_path)

    def sync(self, version: int) -> SyncMetrics:
        """Refresh this rank's share, send it, agree; raise SyncAbortedError / PeerFailureError on failure."""
        rank, mover, board = self.transport.rank, self.transport.mover, self.transport.group.board
        self._attempt += 1
        metrics = SyncMetrics(version, role="sender", rank=rank)
        with PhaseTimer(metrics, "total"):
            error = None
            try:
                self.replica.refresh()
            except Exception as e:  # noqa: BLE001 — agreed on below, so every rank aborts together
                error = f"trainer rank {rank} preparing its share: {describe(e, limit=3)}"
            metrics.add("gather", self.replica.phase_seconds.get("gather", 0.0))
            metrics.add("convert", self.replica.phase_seconds.get("convert", 0.0))
            offsets = {i: self._target * self.plan.set_bytes(i) for i in range(len(self.plan.receivers))}
            with PhaseTimer(metrics, "transfer"):
                if error is not None:
                    fail_share(self.plan, rank, mover, board, version=version, error=error, attempt=self._attempt)
                else:
                    try:
                        stats = send_share(self.plan, rank, self.replica.tensors, mover, board, version=version,
                                           attempt=self._attempt, algorithm=self.checksum, set_offsets=offsets)
                        metrics.bytes, metrics.num_buckets = stats.nbytes, self.messages
                        metrics.add("checksum", stats.checksum_seconds)
                        metrics.phases["transfer"] -= stats.checksum_seconds
                    except PeerFailureError:
                        raise  # a receiver is gone: the transport must be rebuilt
                    except Exception as e:  # noqa: BLE001 — its receivers already have the error
                        error = f"trainer rank {rank} sending: {describe(e, limit=3)}"
            with PhaseTimer(metrics, "commit"):
                sender_rounds(self.transport, version, error)
            self._target = 1 - self._target  # every rank committed: the receivers flipped their sets
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics


class P2PReceiver(Receiver):
    """The inference half on one inference rank: two staging sets of exactly its params."""

    def __init__(self, transport: "Transport", engine: "EngineAdapter", config: "WeightSyncConfig",
                 commit: Optional[Commit] = None) -> None:
        self.transport, self.engine, self.timeout_s = transport, engine, config.timeout_s
        self.index = transport.rank - transport.num_trainer_ranks
        self.plan = handshake(transport, num_trainer_ranks=transport.num_trainer_ranks,
                              engine_tp_size=config.engine_tp_size, bucket_bytes=config.bucket_size_bytes,
                              layout=engine.rank_layout, expected=engine.expected_tensors())
        self.layout = self.plan.receivers[self.index].layout
        self.checksum = resolve_checksum(config.checksum, transport.mover.device)
        self.staging = StagingSets(self.layout, transport.mover.staging_buffer)
        transport.mover.expose(self.index, self.staging.memory)
        self._agreed = AgreedCommit.over(transport, engine, commit, live_shards=self.staging.live_params)
        self.metrics_path = config.metrics_path
        self.history: list[SyncMetrics] = []
        self._attempt = 0  # syncs so far; trainer and engines count them in step

    def receive(self, version: int) -> SyncMetrics:
        """Receive and verify this rank's params of `version`; commit them once every rank agrees."""
        self._attempt += 1
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank,
                              shard_bytes=self.layout.shard_bytes, held_bytes=self.staging.nbytes)
        with PhaseTimer(metrics, "total"):
            error = None
            staged = self.staging.begin()
            try:
                with PhaseTimer(metrics, "transfer"):
                    stats = receive_shards(self.plan, self.index, self.staging.buffer(self.staging.target),
                                           self.transport.mover, self.transport.group.board, version=version,
                                           timeout_s=self.timeout_s, attempt=self._attempt, algorithm=self.checksum)
                metrics.bytes, metrics.num_buckets = stats.nbytes, len(self.plan.incoming(self.index))
                metrics.add("checksum", stats.checksum_seconds)
                metrics.phases["transfer"] -= stats.checksum_seconds
            except PeerFailureError:
                raise  # a sender died or stalls: the transport must be rebuilt; the engine keeps its version
            except SyncError as e:  # a corrupt range, or a sender that reported its failure: agreed on
                error = f"[inference rank {self.index}] {type(e).__name__}: {e}"
            self._agreed(version, error, staged, metrics)
            self.staging.committed(version)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics
