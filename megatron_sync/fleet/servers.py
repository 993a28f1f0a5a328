"""A fleet of driven servers whose transport sends to them directly (SGLang): membership kept on the leader.

With `fleet.enabled` and transport "sglang" the engines are the servers of `weight_sync.engines` (engine id =
the index of its entry). They run no megatron-sync code, so there is no link per engine (`fleet.trainer`):
the transport's rank 0 sends each bucket to every server taking part, and a server's failure (a refused
bucket, ranks that disagree, a server that died) fails only that server (`transports.sglang.transport`).

At every sync, on the trainer's leader (`ServerFleet`; a no-op on the other trainer ranks):
  1. a server that left and answers again rejoins as its next generation: the transport forms a new update
     group with it, and it gets this sync's version before it serves again (until then it serves what it
     started from, and its answers say which version that is);
  2. every server of the fleet is paused and its update opened; one that does not answer leaves the fleet;
  3. with fewer than `fleet.min_engines` left, `FleetTooSmall` is raised (on every trainer rank);
  4. after the transport's agreement each server's outcome is applied: committed (tagged, resumed), restored
     to the previous version (tagged with it, resumed), partial (paused) or left (stopped answering).
Each server has a row per version in `SyncMetrics.fleet`, with the joined / left / rejoined events.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from megatron_sync.core.agreement import describe
from megatron_sync.engines.base import EngineClient
from megatron_sync.engines.driven import EngineFleet
from megatron_sync.fleet.links import Deliveries
from megatron_sync.fleet.roster import EngineState, Roster
from megatron_sync.transports.sglang.transport import COMMITTED, LEFT, RESTORED

log = logging.getLogger("megatron_sync")


class ServerFleet(EngineFleet):
    """The driven servers of a fleet (`EngineFleet` with membership): rejoin, pause, apply the outcomes."""

    def __init__(self, clients: Sequence[EngineClient], *, driven: bool, transport: Any, min_engines: int) -> None:
        super().__init__(clients, driven=driven)
        self.transport, self.min_engines = transport, min_engines
        self.roster = Roster()
        for engine in range(len(self.clients)):
            self.roster.admit(engine, 0)
        self.version = 0  # the last version the fleet committed
        self._rows: list[dict] = []
        self._started = 0.0

    @classmethod
    def over(cls, engines: EngineFleet, transport: Any, min_engines: int) -> "ServerFleet":
        """Return `engines` (joined) as a fleet whose servers `transport` (rank 0, on the leader) sends to."""
        return cls(engines.clients, driven=engines.driven, transport=transport, min_engines=min_engines)

    def before_sync(self, version: int) -> None:
        """Rejoin the servers that answer again, pause every server of the fleet and open its update (one that
        does not answer leaves); raise FleetTooSmall when fewer than min_engines remain."""
        if not self.clients:
            return
        self._started = time.perf_counter()
        for engine in self.roster.gone():
            self._rejoin(engine)
        for record in self.roster.active():
            try:
                self.clients[record.engine].before_sync(version)
            except Exception as e:  # noqa: BLE001 — that server leaves; the others go on
                self._leave(record.engine, f"pausing it for version {version} failed: {describe(e, limit=1)}")
        self.transport.take_part([self.clients[r.engine].url for r in self.roster.active()])
        try:
            self.roster.check_minimum(self.min_engines)
        except Exception:
            self.after_sync(version, ok=False)  # the paused ones resume on what they hold
            raise

    def begin_transfer(self, version: int) -> None:
        """Nothing to start: the transport announces each bucket as it sends it."""

    def after_sync(self, version: int, ok: bool) -> None:
        """Apply each server's outcome of `version` (the transport's `outcomes`) and record its row; never raises
        for one server (a server that fails here leaves the fleet)."""
        if not self.clients:
            return
        outcomes, self.transport.outcomes = self.transport.outcomes, {}
        rows = Deliveries(version)
        for record in self.roster.active():
            client = self.clients[record.engine]
            # no outcome: the sync failed before any bucket reached the servers, which hold what they held
            outcome, reason = outcomes.get(client.url, (COMMITTED, "") if ok else ("unchanged", "the sync failed"))
            if outcome != LEFT:
                try:
                    if outcome == COMMITTED:
                        client.after_sync(version, ok=True)
                        self.roster.committed(record.engine, version)
                    else:
                        held = self.version if outcome == RESTORED else None
                        client.after_sync(version, ok=False, holds=held or None)
                        self.roster.committed(record.engine, held or 0)
                except Exception as e:  # noqa: BLE001 — that server leaves; the others are closed too
                    outcome, reason = LEFT, f"closing its update failed: {describe(e, limit=1)}"
            if outcome == LEFT:
                self._leave(record.engine, reason)
            rows.add(record.engine, record.generation, 0, "trainer",
                     "committed" if outcome == COMMITTED else ("failed" if outcome == LEFT else "aborted"),
                     time.perf_counter() - self._started, reason=reason)
        if ok:
            self.version = version
        self._rows = rows.rows + self.roster.take_events()

    def take_rows(self) -> list[dict]:
        """Return the rows of the last version and the membership events since (leader; [] elsewhere)."""
        rows, self._rows = self._rows, []
        return rows

    def _rejoin(self, engine: int) -> None:
        client = self.clients[engine]
        try:
            self.transport.rejoin(client.url)
        except Exception as e:  # noqa: BLE001 — not back (yet): asked again at the next sync
            log.info("fleet: SGLang at %s (engine %d) is not back: %s", client.url, engine, describe(e, limit=1))
            return
        record = self.roster.admit(engine, self.roster.engines[engine].generation + 1)
        log.info("fleet: %s (engine %d) answers again and rejoins as generation %d; %d engine(s) in the fleet",
                 client.url, engine, record.generation, len(self.roster.active()))

    def _leave(self, engine: int, reason: str) -> None:
        if self.roster.engines[engine].state is EngineState.GONE:
            return
        self.roster.leave(engine, reason)
        log.warning("fleet: %s (engine %d) left the fleet: %s; %d engine(s) serve on", self.clients[engine].url,
                    engine, reason, len(self.roster.active()))
