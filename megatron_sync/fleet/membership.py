"""A fleet's membership at sync boundaries, the trainer's side (the leader decides, the other trainer ranks
follow what it shares): who is still there, who gets a link, who left, and whether `min_engines` remain.
`FleetDriver` (`fleet/trainer.py`) is built on it and walks a sync's waves over the links it keeps.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.checksum import resolve_checksum
from megatron_sync.core.errors import PlanMismatchError
from megatron_sync.core.wait import WaitTimeout, poll
from megatron_sync.engines.base import fleet_rendezvous
from megatron_sync.engines.driven import JOIN_GRACE_S
from megatron_sync.fleet.links import Link, link_name
from megatron_sync.fleet.roster import FleetTooSmall
from megatron_sync.session.liveness import unanswered
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.transports.buckets.plan_agreement import handshake_plan
from megatron_sync.transports.buckets.sender import WeightSender

log = logging.getLogger("megatron_sync")

OPEN_KEY = "fleet/open/{engine}/{generation}"
"""Posted by the leader (under the session store's root) when an engine's link is being built: b"open", or
b"refused: <why>" for a job that will not get one (superseded before its link was built)."""


def link_config(config: WeightSyncConfig) -> WeightSyncConfig:
    """Return the settings one engine's link is built with: a transport whose inference side is one engine."""
    return config.replace(num_inference_ranks=config.engine_tp_size, fleet=False, engine_id=None, min_engines=1,
                          wave_size=0, relay=False, max_staleness=0, engines=())


def engine_layout_digest(rows: Sequence[dict]) -> str:
    """Return the digest of an engine's rank layouts ("" unless every rank can relay)."""
    if not rows or not all(row.get("relays") for row in rows):
        return ""
    return hashlib.sha256("|".join(row["layout"] for row in rows).encode()).hexdigest()


class Membership:
    """The boundary steps of a `FleetDriver` (its state: links, held, roster, clients, session, gather)."""

    def start(self) -> None:
        """Wait (leader, up to timeout_s) for the initial fleet, then link it; collective on the trainer ranks."""
        if self.is_leader:
            # driven engines: exactly those (their joins return only once linked); else num_engines of any ids
            driven, wanted = set(self.clients), self.config.num_engines

            def ready() -> bool:
                admitted = self.session.admitted_engines()
                return driven <= set(admitted) if driven else len(admitted) >= wanted

            try:
                poll(ready, within=self.config.timeout_s, what="the initial fleet joining")
            except WaitTimeout:
                pass  # going on with the engines that came (said below)
            have = sorted(self.session.admitted_engines())
            if not ready():
                log.warning("fleet: engines %s joined within %gs, not the %s expected; going on with them", have,
                            self.config.timeout_s, sorted(driven) if driven else f"{wanted}")
        self._boundary()

    def _from_leader(self, value: Any) -> Any:
        """Return the leader's `value` on every trainer rank (the trainer's all-gather)."""
        shared = self.gather({"leader": self.is_leader, "value": value})
        return next(entry["value"] for entry in shared if entry["leader"])

    def _boundary(self) -> None:
        """Between syncs: finish background waves, drop superseded links, open new ones, check the minimum."""
        self._join_background()
        if self.is_leader:
            self._rejoin_driven()
        changes = self._membership() if self.is_leader else None
        changes = self._from_leader(changes)
        for engine, reason in changes["drop"]:
            self._drop(int(engine), reason)
        opened: dict[int, Any] = {}
        if self.joins:
            for engine, generation in changes["open"]:
                opened[engine] = self._open(int(engine), int(generation))
        reports = self.gather({str(e): (None if isinstance(link, Link) else link) for e, link in opened.items()})
        for engine, generation in changes["open"]:
            problems = [r[str(engine)] for r in reports if str(engine) in r and r[str(engine)] is not None]
            link = opened.get(engine)
            if problems:
                if isinstance(link, Link):
                    link.close()
                if self.is_leader:
                    log.warning("fleet: engine %d (generation %d) could not be linked and is left out: %s",
                                engine, generation, problems[0])
                continue
            layouts = self._from_leader(link.layout if isinstance(link, Link) else None)
            if isinstance(link, Link):
                link.layout = layouts
            self.links[engine] = link if isinstance(link, Link) else Link(engine, generation, None, layouts)
            self.held[engine] = 0
            if self.is_leader:
                self.roster.admit(engine, generation, layouts)
                log.info("fleet: engine %d (generation %d) joined; %d engine(s) in the fleet", engine, generation,
                         len(self.links))
        if self.is_leader:
            self._finish_rejoins()
        self._check_minimum()

    def _rejoin_driven(self) -> None:
        """Leader: ask every driven engine that left the fleet to join again (its server may have been restarted:
        a new job, so its engine's next generation), and wait up to timeout_s for those that answer to be
        admitted, so they are linked at this boundary. One not back yet is asked again at the next boundary."""
        asked = {}
        backend = self.config.resolved_backend(torch.cuda.is_available())
        config = self.config.replace(run_id=self.session.id, backend=backend, engines=())
        for engine, client in sorted(self.clients.items()):
            record = self.roster.engines.get(engine)
            if engine in self.links or engine in self._rejoining or record is None:
                continue  # serving, already rejoining, or its first join is the start-up's
            try:
                self._rejoining[engine] = client.join(fleet_rendezvous(config, self.layout.pp, engine,
                                                                       self.config.engine_tp_size))
            except Exception as e:  # noqa: BLE001 — not back (yet): asked again at the next boundary
                log.info("fleet: engine %d (%s) did not take a new join: %s", engine, client.url,
                         describe(e, limit=1))
                continue
            asked[engine] = record.generation
            log.info("fleet: engine %d (%s) answers again; it joins as generation > %d", engine, client.url,
                     record.generation)
        def admitted_or_ended() -> bool:
            admitted = self.session.admitted_engines()
            if all(admitted.get(e, (-1, ""))[0] > g for e, g in asked.items()):
                return True
            return any(self._rejoining[e].done() for e in asked)  # a join that ended before its admission failed

        if asked:
            try:
                poll(admitted_or_ended, within=self.config.timeout_s, what="the rejoining engines' admission")
            except WaitTimeout:
                pass  # not admitted in time: asked again at the next boundary

    def _finish_rejoins(self) -> None:
        """Leader: collect the driven engines' join calls that ended (linked, or failed: asked again later)."""
        for engine, call in list(self._rejoining.items()):
            if not (engine in self.links or call.done()):
                continue
            del self._rejoining[engine]
            try:
                call.wait(self.config.timeout_s + JOIN_GRACE_S)
            except Exception as e:  # noqa: BLE001 — its link (if any) fails at its next transfer and is dropped
                log.warning("fleet: engine %d's new join failed: %s", engine, describe(e, limit=1))

    def _membership(self) -> dict:
        """Leader: the links to drop (engines that do not answer, superseded generations) and to open (engines
        admitted since)."""
        silent = unanswered(self.session.store, {e: link.generation for e, link in self.links.items()},
                            self.config.engine_tp_size) if self.links else {}
        drop, open_ = [[engine, reason] for engine, reason in sorted(silent.items())], []
        for engine, (generation, job) in sorted(self.session.admitted_engines().items()):
            link = self.links.get(engine)
            if link is not None and link.generation < generation and engine not in silent:
                drop.append([engine, f"superseded by job {job!r} (generation {generation}): it was restarted"])
            if (engine, generation) not in self._known:  # a generation gets one link: a new job for a new one
                self._known.add((engine, generation))
                open_.append([engine, generation])
                self._board.post(OPEN_KEY.format(engine=engine, generation=generation), b"open")
        return {"drop": drop, "open": open_}

    def _open(self, engine: int, generation: int) -> Any:
        """Stage source: build the engine's link and agree on the plan over it; return the Link, or the error."""
        transport = None
        try:
            part = self.session.part(link_name(engine, generation))
            transport = self.transport_cls.connect_trainer(self.link_config, self.layout, session=part)
            algorithm = resolve_checksum(self.config.checksum, transport.device)
            plan = handshake_plan(transport, self.stream.metadata(), self.config.bucket_size_bytes,
                                  self.keep_together, checksum=algorithm)
            if self.plan is None:
                self.plan = plan
                self.sender = WeightSender(self.stream, self.fanout, plan, metrics_path=self.config.metrics_path,
                                           checksum=self.config.checksum)
            elif plan.digest() != self.plan.digest():
                raise PlanMismatchError(f"engine {engine}'s link agreed on another plan than the fleet's")
            hello = transport.all_gather_json({"stage": self.layout.pp_rank})
            rows = hello[transport.inference_ranks.start:]
            return Link(engine, generation, transport, engine_layout_digest(rows), all(r.get("relays") for r in rows))
        except Exception as e:  # noqa: BLE001 — agreed on by every source, then the engine is left out
            if transport is not None:
                transport.close()
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _drop(self, engine: int, reason: str) -> None:
        """The engine leaves the fleet: close its link; the leader logs one line and records the event."""
        link = self.links.pop(engine, None)
        self.held.pop(engine, None)
        if link is None:
            return
        link.close()
        if self.is_leader:
            self.roster.leave(engine, reason)
            log.warning("fleet: engine %d (generation %d) left the fleet: %s; %d engine(s) serve on", engine,
                        link.generation, reason, len(self.links))

    def _check_minimum(self) -> None:
        if len(self.links) < self.config.min_engines:
            gone = self.roster.gone() if self.is_leader else []
            raise FleetTooSmall(f"{len(self.links)} engine(s) left in the fleet, fewer than "
                                f"weight_sync.fleet.min_engines={self.config.min_engines}"
                                + (f" (gone: engines {gone})" if gone else "")
                                + "; restart them (each rejoins with its weight_sync.engine_id) or lower min_engines")

    # ---- one sync ----

