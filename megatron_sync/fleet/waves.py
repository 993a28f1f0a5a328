"""Who brings a version to which engine, in which wave: the delivery plan of one version; pure.

Engines not in the current wave keep serving the version they hold, so a fleet
updated in waves of `wave_size` always has most of its engines serving. With
`relay`, only one engine of each layout (engines whose ranks hold the same
regions, compared by layout digest) gets the version from the trainer; every
other one gets it from an engine that already committed it, each holder
serving one engine per wave (the holders double every wave), so the trainer's
upload per version is one copy per layout however many engines there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from megatron_sync.fleet.roster import EngineRecord

TRAINER = "trainer"


@dataclass(frozen=True)
class Delivery:
    """`engine` receives the version from `source`: TRAINER or the id of an engine that holds it."""

    engine: int
    source: Union[int, str]

    @property
    def relayed(self) -> bool:
        return self.source != TRAINER

    def to_wire(self) -> list:
        return [self.engine, self.source]

    @classmethod
    def from_wire(cls, wire: Sequence) -> "Delivery":
        return cls(int(wire[0]), wire[1] if wire[1] == TRAINER else int(wire[1]))


def plan_waves(behind: Sequence[EngineRecord], holders: Sequence[EngineRecord] = (), *, wave_size: int = 0,
               relay: bool = False) -> list[list[Delivery]]:
    """Return the waves bringing every engine in `behind` to the version that `holders` already hold.

    Engines go in id order; `wave_size` bounds a wave (0: no bound). Without `relay` every delivery
    comes from the trainer. With it, an engine comes from a holder of its layout when one is free
    in that wave, from the trainer only when its layout has no holder yet (then it is the only one
    of its layout in that wave).
    """
    if wave_size < 0:
        raise ValueError(f"wave_size={wave_size} must be >= 0 (0: every engine at once)")
    pending = sorted(behind, key=lambda r: r.engine)
    held = list(holders)
    waves: list[list[Delivery]] = []
    while pending:
        limit = wave_size or len(pending)
        wave, free, fed = [], list(held), set()  # fed: layouts the trainer serves in this wave
        for record in list(pending):
            if len(wave) == limit:
                break
            eligible = relay and bool(record.layout)  # an engine of unknown layout gets the trainer's bytes
            source = next((h for h in free if eligible and h.layout == record.layout), None)
            if source is not None:
                free.remove(source)
                wave.append(Delivery(record.engine, source.engine))
            elif not eligible or (record.layout not in fed and not any(h.layout == record.layout for h in held)):
                fed.add(record.layout)
                wave.append(Delivery(record.engine, TRAINER))
            else:
                continue  # waits for a holder of its layout to be free in a later wave
            pending.remove(record)
        assert wave, "every wave delivers to at least one engine"
        waves.append(wave)
        held += [r for r in sorted(behind, key=lambda r: r.engine) if r.engine in {d.engine for d in wave}]
    return waves
