"""The inference half of a P2P sync on one inference rank: two staging sets, a window, rounds, agreement.

Two staging sets of exactly this rank's params (its layout's params back to back,
`megatron_sync.layout.staging`) are allocated once on the mover's device; a version is received into the set
the engine does not run from (both sides flip sets after every version all ranks committed), so the other set
is the live version and its rollback source. With `staging_sets: 1` (the trainer's setting) there is one set,
and a host copy of the live version, taken between syncs, is the rollback source; this rank posts where its
set starts once it may be written, and its writers wait for that. The window writes land in is the sets
themselves (registered and exposed once), or, with a bounded `p2p_window_mb`, a separate registered window
whose rounds are copied into the target set. `RoundReceiver` receives, verifies and forwards round by round;
then the two rounds of `session/commit.py` make the set live everywhere or nowhere.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics
from megatron_sync.layout.loaded import LoadCheck
from megatron_sync.layout.staging import StagingSets, copies_shards
from megatron_sync.session.commit import AgreedCommit
from megatron_sync.transports.base import Commit, Receiver
from megatron_sync.transports.p2p.endpoint import P2PEndpoint
from megatron_sync.transports.p2p.handshake import handshake
from megatron_sync.transports.p2p.notices import Board, Notices, engine_boards, receiver
from megatron_sync.transports.p2p.rounds import Route, RoundReceiver

if TYPE_CHECKING:
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.session.group import TransportGroup
    from megatron_sync.settings.config import WeightSyncConfig


class P2PReceiver(Receiver):
    """One inference rank's P2P receiver (see the module doc)."""

    def __init__(self, transport: P2PEndpoint, engine: "EngineAdapter", config: "WeightSyncConfig",
                 commit: Optional[Commit] = None) -> None:
        self.transport, self.engine = transport, engine
        self.index = transport.rank - transport.num_trainer_ranks
        self.schedule = handshake(transport, num_trainer_ranks=transport.num_trainer_ranks,
                                  engine_tp_size=config.engine_tp_size, layout=engine.rank_layout,
                                  expected=engine.expected_tensors(), copies=copies_shards(engine))
        mover = transport.mover
        self.layout = self.schedule.receivers[self.index].layout
        self.staging = StagingSets(self.layout, mover.alloc, self.schedule.options.staging_sets,
                                   timeout_s=config.timeout_s)
        bounded = bool(self.schedule.options.window_bytes)
        self.window = mover.alloc(self.schedule.window_bytes(self.index)) if bounded else self.staging.memory
        mover.expose(receiver(self.index), self.window)
        self.rounds = RoundReceiver(self.schedule, self.index, mover, self.window,
                                    algorithm=resolve_checksum(config.checksum, mover.device),
                                    timeout_s=config.timeout_s)
        algorithm = resolve_checksum(config.checksum, mover.device)
        self.check = LoadCheck(self.layout, engine, algorithm, config.verify_every, f"inference rank {self.index}")
        self._notice_board = engine_boards(transport.group, self.schedule.receivers)
        self._agreed = AgreedCommit.over(transport, engine, commit, live_shards=self.staging.live_params,
                                         check=self.check)
        self.fleet: Optional[FleetPlace] = None  # set by a fleet engine: where engines chain across links
        self.metrics_path = config.metrics_path
        self.history: list[SyncMetrics] = []
        self._attempt = 0  # syncs so far; trainer and engines count them in step

    def live_shards(self, version: int):
        return self.staging.live_params(version)

    def join_fleet(self, board: Board, engine: int, generation: int) -> None:
        """Expose this rank's window to the fleet's other engines too (on the session's root `board`), so an
        engine chained before this one can forward into it."""
        self.fleet = FleetPlace(board, engine, generation, self.index, self.transport.group)
        self.transport.mover.route(FLEET, board)
        self.transport.mover.expose(self.fleet.name(engine, generation), self.window)

    def receive(self, version: int, route: Optional[dict] = None) -> SyncMetrics:
        """Receive, verify (and forward) this rank's params of `version` along `route` (a fleet's: the engines
        before and after this one, and the sync's number); commit them once every rank agrees."""
        self._attempt += 1
        notices = Notices(self.transport.group.control_board(), version, self._attempt, shards=self._notice_board)
        path = self.fleet.route(version, route) if route and self.fleet is not None else None
        metrics = SyncMetrics(version, role="receiver", rank=self.transport.rank,
                              shard_bytes=self.layout.shard_bytes, held_bytes=self.staging.nbytes)
        metrics.started_at = time.time()
        with PhaseTimer(metrics, "total"):
            error = None
            staged, target = self.staging.begin(), self.staging.target
            self.check.begin(version)
            base = target * self.staging.set_bytes
            try:
                with PhaseTimer(metrics, "transfer"):
                    stats = self.rounds.receive_version(notices, self.staging.buffer(target), base, path)
                metrics.bytes, metrics.num_buckets = stats.nbytes, self.schedule.rounds[self.index]
                for p in self.schedule.incoming(self.index):  # the trainer's own digests of what it wrote
                    self.check.record_piece(p.dst, p.nbytes, p.name, f"rows {p.row}..{p.row + p.rows - 1}",
                                            stats.sums[p.index])
                metrics.add("checksum", stats.checksum_seconds)
                metrics.add("pack", stats.copy_seconds)
                metrics.phases["transfer"] -= stats.checksum_seconds + stats.copy_seconds
            except PeerFailureError:
                raise  # a writer died or stalls: the transport must be rebuilt; the engine keeps its version
            except SyncError as e:  # a corrupt piece, or a writer that reported its failure: agreed on
                error = f"[inference rank {self.index}] {type(e).__name__}: {e}"
            try:
                self._agreed(version, error, staged, metrics)
            except PeerFailureError:
                raise  # the store may be gone or silent: nothing to tidy there
            except SyncError:
                self._forget(notices, path)  # every rank agreed to abort: every writer is past this attempt
                raise
            self.staging.committed(version)
            self._forget(notices, path)
        self.history.append(metrics)
        metrics.append_to(self.metrics_path)
        return metrics

    def _forget(self, notices: Notices, path: Optional[Route]) -> None:
        """Delete this rank's notices of the attempt once every rank agreed on it (`Notices.forget`)."""
        rounds = self.schedule.rounds[self.index]
        notices.forget(self.index, rounds)
        if path is not None and path.feed is not None:
            path.feed_notices.forget(path.me, rounds)


FLEET = "fleet/"
"""Endpoints of a fleet's engines, addressed across their links through the session's root store."""


class FleetPlace:
    """Where one engine rank sits in a fleet: its engine, generation and rank, the root board chained engines
    meet on, and `group`, this engine's link. The reports of the rounds written into an engine go to the notice
    store of that engine's link (hosted by the trainer's leader beside the root store), so each engine's
    reports have a store of their own, as in one session of many engines (`session/shards.py`); each engine
    posts its link's name on the root board for the engine chained before it."""

    def __init__(self, board: Board, engine: int, generation: int, rank: int, group: TransportGroup) -> None:
        self.board, self.engine, self.generation, self.rank, self.group = board, engine, generation, rank, group
        self._own = (engine, generation)
        self._links: dict[tuple[int, int], str] = {self._own: group.group_name}
        if rank == 0:
            board.post(self._link_key(engine, generation), group.group_name.encode())

    def name(self, engine: int, generation: int) -> str:
        """Return the endpoint of rank `rank` of `engine`'s `generation` in the fleet."""
        return f"{FLEET}e{engine}g{generation}/r{self.rank}"

    def route(self, version: int, wire: dict) -> Route:
        """Return this rank's route of `version` from the leader's announcement (feed and next as [engine,
        generation], and the fleet's sync number the keys are named by)."""
        def notices(engine: int, generation: int) -> Notices:  # the keys of the rounds written into `engine`
            return Notices(self.notice_board(engine, generation), version, f"{wire['sync']}.e{engine}")

        feed, after = wire.get("feed"), wire.get("next")
        return Route(self.name(self.engine, self.generation), self.rank,
                     feed=None if feed is None else self.name(*feed),
                     feed_notices=notices(self.engine, self.generation),
                     next=None if after is None else self.name(*after), next_index=self.rank,
                     next_notices=None if after is None else notices(*after))

    def notice_board(self, engine: int, generation: int) -> Board:
        """Return this rank's board on the notice store of `engine`'s `generation` link (one engine a link)."""
        key = (engine, generation)
        if key not in self._links:
            for earlier in [k for k in self._links if k[0] == engine and k[1] < generation and k != self._own]:
                self.group.close_notice_shards(self._links.pop(earlier))  # that engine was restarted
            self._links[key] = self.board.fetch(self._link_key(engine, generation)).decode()
        return self.group.notice_shards(1, of=self._links[key]).board(0)

    @staticmethod
    def _link_key(engine: int, generation: int) -> str:
        return f"{FLEET}e{engine}g{generation}/link"
