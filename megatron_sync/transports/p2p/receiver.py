"""The inference half of a P2P sync on one inference rank: two staging sets, a window, rounds, agreement.

Two staging sets of exactly this rank's params (its layout's params back to back,
`megatron_sync.layout.staging`) are allocated once on the mover's device; a version is received into the set
the engine does not run from (both sides flip sets after every version all ranks committed), so the other set
is the live version and its rollback source. The window writes land in is both sets themselves (registered
and exposed once), or, with a bounded `p2p_window_mb`, a separate registered window whose rounds are copied
into the target set. `RoundReceiver` receives, verifies and forwards round by round; then the two rounds of
`session/commit.py` make the set live everywhere or nowhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.layout.staging import StagingSets
from megatron_sync.session.commit import AgreedCommit
from megatron_sync.transports.base import Commit, Receiver
from megatron_sync.transports.p2p.handshake import handshake
from megatron_sync.transports.p2p.notices import Notices, receiver
from megatron_sync.transports.p2p.rounds import RoundReceiver

if TYPE_CHECKING:
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.transports.p2p.transport import P2PTransport


class P2PReceiver(Receiver):
    """One inference rank's P2P receiver (see the module doc)."""

    def __init__(self, transport: "P2PTransport", engine: "EngineAdapter", config: "WeightSyncConfig",
                 commit: Optional[Commit] = None) -> None:
        self.transport, self.engine = transport, engine
        self.index = transport.rank - transport.num_trainer_ranks
        self.schedule = handshake(transport, num_trainer_ranks=transport.num_trainer_ranks,
                                  engine_tp_size=config.engine_tp_size, layout=engine.rank_layout,
                                  expected=engine.expected_tensors())
        mover = transport.mover
        self.layout = self.schedule.receivers[self.index].layout
        self.staging = StagingSets(self.layout, mover.alloc)
        bounded = bool(self.schedule.options.window_bytes)
        self.window = mover.alloc(self.schedule.window_bytes(self.index)) if bounded else self.staging.memory
        mover.expose(receiver(self.index), self.window)
        self.rounds = RoundReceiver(self.schedule, self.index, mover, self.window,
                                    algorithm=resolve_checksum(config.checksum, mover.device),
                                    timeout_s=config.timeout_s)
        self._agreed = AgreedCommit.over(transport, engine, commit, live_shards=self.staging.live_params)
        self.metrics_path = config.metrics_path
        self.history: list[SyncMetrics] = []
        self._attempt = 0  # syncs so far; trainer and engines count them in step

    def live_shards(self, version: int):
        return self.staging.live_params(version)

    def receive(self, version: int) -> SyncMetrics:
        """Receive, verify (and forward) this rank's params of `version`; commit them once every rank agrees."""
        self._attempt += 1
        notices = Notices(self.transport.group.board, version, self._attempt)
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank,
                              shard_bytes=self.layout.shard_bytes, held_bytes=self.staging.nbytes)
        with PhaseTimer(metrics, "total"):
            error = None
            staged, target = self.staging.begin(), self.staging.target
            base = target * self.staging.set_bytes
            try:
                with PhaseTimer(metrics, "transfer"):
                    stats = self.rounds.receive_version(notices, self.staging.buffer(target), base, base)
                metrics.bytes, metrics.num_buckets = stats.nbytes, self.schedule.rounds[self.index]
                metrics.add("checksum", stats.checksum_seconds)
                metrics.add("pack", stats.copy_seconds)
                metrics.phases["transfer"] -= stats.checksum_seconds + stats.copy_seconds
            except PeerFailureError:
                raise  # a writer died or stalls: the transport must be rebuilt; the engine keeps its version
            except SyncError as e:  # a corrupt piece, or a writer that reported its failure: agreed on
                error = f"[inference rank {self.index}] {type(e).__name__}: {e}"
            self._agreed(version, error, staged, metrics)
            self.staging.committed(version)
            if self.schedule.options.window_bytes:
                notices.forget_releases(self.index, self.schedule.rounds[self.index])
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics
