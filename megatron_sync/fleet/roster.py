"""The fleet's roster: which engines take part, since when, at which version; pure, no processes.

The trainer's leader keeps one. An engine is identified by its id (the
`weight_sync.engine_id` its job presents, or a driven engine's index); every
admission of a new job for an id is a new generation, given by the rendezvous
(`rendezvous.Admission`), so an engine that left and came back is told apart
from its earlier self. Every change is an event (joined, left, rejoined), with
the time, for the sync metrics.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


class EngineState(enum.Enum):
    SERVING = "serving"  # linked to the trainer; holds `version` (0: none of this trainer's yet)
    GONE = "gone"  # failed, vanished, superseded or left; may come back as a new generation


@dataclass(frozen=True)
class EngineRecord:
    """One engine of the fleet as the leader knows it."""

    engine: int
    generation: int
    state: EngineState
    version: int = 0  # the version it committed last (0: none synced by this trainer yet)
    layout: str = ""  # digest of its ranks' layouts ("" when it cannot relay): equal digests relay to each other


@dataclass(frozen=True)
class FleetEvent:
    """Something that happened to an engine: joined, left or rejoined (with the version it held)."""

    engine: int
    generation: int
    kind: str
    version: int
    at: float
    detail: str = ""

    def to_row(self) -> dict:
        return {"event": self.kind, "engine": self.engine, "generation": self.generation, "version": self.version,
                "at": round(self.at, 6), **({"detail": self.detail} if self.detail else {})}


@dataclass
class Roster:
    """Every engine the trainer has seen, its state, and the events so far."""

    engines: dict[int, EngineRecord] = field(default_factory=dict)
    events: list[FleetEvent] = field(default_factory=list)
    clock: Callable[[], float] = time.time

    def admit(self, engine: int, generation: int, layout: str = "") -> EngineRecord:
        """`engine` joined (its link is open) as `generation`: "joined" the first time, "rejoined" after."""
        known = self.engines.get(engine)
        if known is not None and known.state is EngineState.SERVING and known.generation >= generation:
            raise ValueError(f"engine {engine} is already in the fleet as generation {known.generation}")
        record = EngineRecord(engine, generation, EngineState.SERVING, version=0, layout=layout)
        self.engines[engine] = record
        self._event(record, "rejoined" if known is not None else "joined")
        return record

    def committed(self, engine: int, version: int) -> None:
        """`engine` committed `version`."""
        self.engines[engine] = dataclasses.replace(self.engines[engine], version=version)

    def leave(self, engine: int, reason: str) -> EngineRecord:
        """`engine` failed, vanished, was superseded or stopped; it keeps its id for a later rejoin."""
        record = dataclasses.replace(self.engines[engine], state=EngineState.GONE)
        self.engines[engine] = record
        self._event(record, "left", detail=reason)
        return record

    def active(self) -> list[EngineRecord]:
        """Engines that take part in syncs, by id."""
        return sorted((r for r in self.engines.values() if r.state is EngineState.SERVING), key=lambda r: r.engine)

    def gone(self) -> list[int]:
        return sorted(r.engine for r in self.engines.values() if r.state is EngineState.GONE)

    def take_events(self) -> list[dict]:
        """Return the events since the last call, as metric rows."""
        rows, self.events = [e.to_row() for e in self.events], []
        return rows

    def _event(self, record: EngineRecord, kind: str, detail: str = "") -> None:
        self.events.append(FleetEvent(record.engine, record.generation, kind, record.version, self.clock(), detail))

    def check_minimum(self, minimum: Optional[int]) -> None:
        """Raise FleetTooSmall when fewer than `minimum` engines are active (None: no minimum)."""
        if minimum is not None and len(self.active()) < minimum:
            raise FleetTooSmall(f"{len(self.active())} engine(s) left in the fleet, fewer than "
                                f"weight_sync.fleet.min_engines={minimum} (gone: engines {self.gone()}); restart them "
                                "(each rejoins with its weight_sync.engine_id) or lower min_engines")


class FleetTooSmall(RuntimeError):
    """Fewer engines remain than `weight_sync.fleet.min_engines` allows."""
