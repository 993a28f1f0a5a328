"""Per-sync measurements: phase times, bytes, throughput, overlap, an optional timeline; JSON lines and a table."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

PHASES = ("gather", "convert", "pack", "checksum", "transfer", "apply", "verify", "commit", "release", "restore",
          "total")
"""Seconds per phase of a sync; "verify" checks what the engine holds once loaded (`layout.loaded`) and scores
the canary; "release" / "restore" time the memory handoff of colocated jobs (`megatron_sync.engines.handoff`,
rows of roles "engine-handoff" and "trainer-handoff")."""
HANDOFF_PHASES = ("release", "restore")

TIMELINE_PHASES = ("gather", "convert", "pack", "checksum", "wire", "verify", "stage", "load", "commit")
"""Event kinds of a `Timeline`: what one rank did, per unit or bucket, from start to end."""


class Timeline:
    """Start/end events of one rank during one sync: (phase, item, start, end), seconds.

    Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: comparable
    between processes of one host); `wall_origin` / `perf_origin` map them to
    wall-clock time for other hosts. `item` is a bucket index, or a gather-unit
    index for gather / convert, or -1. Appending is thread-safe (the sender's
    gather runs in its own thread) and costs one tuple per event.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float, float]] = []
        self.wall_origin, self.perf_origin = time.time(), time.perf_counter()
        self._lock = threading.Lock()

    def add(self, phase: str, item: int, start: float, end: float) -> None:
        """Record that `phase` ran for `item` from `start` to `end` (perf_counter seconds)."""
        assert phase in TIMELINE_PHASES, phase
        with self._lock:
            self.events.append((phase, item, start, end))

    def to_wire(self) -> dict:
        """Return a JSON-serialisable form (wall-clock times)."""
        shift = self.wall_origin - self.perf_origin
        return {"events": [[p, i, round(s + shift, 6), round(e + shift, 6)] for p, i, s, e in self.events]}


@dataclass
class SyncMetrics:
    """What one rank measured during one sync.

    `phases` holds seconds per phase (see PHASES). On a sender, "gather" is the
    time spent pulling the HF stream (gather + convert happen inside it, so
    "convert" stays 0 unless the stream reports it separately), "transfer" is
    time spent *waiting* for broadcasts, and `overlap_s` is how long a broadcast
    ran while the next bucket was being produced.
    """

    version: int
    role: str = ""
    rank: int = -1
    phases: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    bytes: int = 0
    """Bytes this rank moved at the transport (sent, or received)."""
    overlap_s: float = 0.0
    num_buckets: int = 0
    shard_bytes: int = 0
    """A receiver's share: the bytes of every region its layout needs (what an exact transport moves to it)."""
    copied_bytes: int = 0
    """Bytes a receiver copied into its staging set (0 where the transport writes there itself)."""
    held_bytes: int = 0
    """Host or device memory a receiver keeps between syncs (staging sets, receive buffers)."""
    media_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes this rank moved per medium during the sync, where the transport counts them (ipc: "shm"
    through shared memory, "socket" in control messages over the store); empty otherwise."""
    timeline: Optional[Timeline] = None
    """Per-bucket start/end events, when the sender or receiver was asked to record them."""
    started_at: float = 0.0
    ended_at: float = 0.0
    """Wall-clock time (time.time()) this rank's part of the sync began and ended (a receiver: from taking the
    version in until it had loaded it and cast its last vote, `session/commit.py`; the version is live once
    every rank has)."""
    source: str = ""
    """A fleet receiver: where the version came from ("trainer", or "engine N" for a relay)."""
    fleet: list = field(default_factory=list)
    """A fleet trainer: one row per engine per version (engine, generation, wave, source trainer/engine N,
    outcome committed/aborted/failed, seconds from the sync's start until it served the version) and the
    membership events since the last sync (joined, left, rejoined)."""
    staleness: int = 0
    """A fleet trainer: how many versions the furthest-behind engine still serving was behind when sync()
    returned (0 unless max_staleness lets later waves run on while training goes on)."""
    canary: list = field(default_factory=list)
    """An engine's first rank: its per-token log-probabilities of the canary sequence once it loaded the version."""
    drift: dict = field(default_factory=dict)
    """The trainer's leader: per engine ("0", "1", ...) the largest and the mean |Δ log-probability| between the
    engine's canary scores and the trainer's own forward ({"max": .., "mean": ..})."""

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase`."""
        assert phase in self.phases, phase
        self.phases[phase] += seconds

    def event(self, phase: str, item: int, start: float, end: float) -> None:
        """Add a timeline event (no-op unless a timeline is being recorded)."""
        if self.timeline is not None:
            self.timeline.add(phase, item, start, end)

    @property
    def gbps(self) -> float:
        """Return bytes moved per total second, in GB/s (1e9 bytes)."""
        total = self.phases["total"]
        return self.bytes / total / 1e9 if total > 0 else 0.0

    def to_json(self) -> str:
        """Return one JSON line describing this sync."""
        return json.dumps({
            "version": self.version, "role": self.role, "rank": self.rank,
            "phases_s": {k: round(v, 6) for k, v in self.phases.items()},
            "bytes": self.bytes, "gbps": round(self.gbps, 4),
            "overlap_s": round(self.overlap_s, 6), "num_buckets": self.num_buckets,
            "shard_bytes": self.shard_bytes, "copied_bytes": self.copied_bytes, "held_bytes": self.held_bytes,
            **({"started_at": round(self.started_at, 6), "ended_at": round(self.ended_at, 6)}
               if self.started_at else {}),
            **({"source": self.source} if self.source else {}),
            **({"fleet": self.fleet, "staleness": self.staleness} if self.fleet else {}),
            **({"media_bytes": self.media_bytes} if self.media_bytes else {}),
            **({"canary": self.canary} if self.canary else {}),
            **({"drift": self.drift} if self.drift else {}),
        }, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "SyncMetrics":
        """Return the metrics that `to_json()` described (for rows gathered from other ranks)."""
        d = json.loads(line)
        phases = {p: 0.0 for p in PHASES}
        phases.update(d["phases_s"])
        return cls(
            d["version"], role=d["role"], rank=d["rank"], phases=phases,
            bytes=d["bytes"], overlap_s=d["overlap_s"], num_buckets=d["num_buckets"],
            shard_bytes=d.get("shard_bytes", 0), copied_bytes=d.get("copied_bytes", 0),
            held_bytes=d.get("held_bytes", 0), started_at=d.get("started_at", 0.0), ended_at=d.get("ended_at", 0.0),
            source=d.get("source", ""), fleet=d.get("fleet", []), staleness=d.get("staleness", 0),
            media_bytes=dict(d.get("media_bytes", {})), canary=list(d.get("canary", [])), drift=dict(d.get("drift", {})),
        )

    def append_to(self, path: Optional[str]) -> None:
        """Append `to_json()` as a line to `path` (no-op when path is None)."""
        if path:
            with open(path, "a") as f:
                f.write(self.to_json() + "\n")


class PhaseTimer:
    """Context manager: on exit, adds the elapsed wall time to a phase of a SyncMetrics, and
    records a timeline event `event=(phase, item)` when the metrics keep a timeline."""

    def __init__(self, metrics: Optional[SyncMetrics], phase: str,
                 event: Optional[tuple[str, int]] = None) -> None:
        self.metrics, self.phase, self._event = metrics, phase, event
        self.elapsed = 0.0

    def __enter__(self) -> "PhaseTimer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        self.elapsed = end - self._start
        if self.metrics is not None:
            self.metrics.add(self.phase, self.elapsed)
            if self._event is not None:
                self.metrics.event(*self._event, self._start, end)


def align(header: list[str], rows: Iterable[list[str]]) -> str:
    """Return `header` and `rows` (cells as text) as a table of right-aligned columns."""
    lines = [header, *rows]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)


def format_table(rows: Iterable[SyncMetrics]) -> str:
    """Return an aligned text table: one row per sync, one column per phase (seconds; the handoff's
    release / restore only when some row has them)."""
    rows = list(rows)
    phases = [p for p in PHASES if p not in HANDOFF_PHASES or any(m.phases[p] for m in rows)]
    drift = any(m.drift for m in rows)
    header = ["version", "role", "rank", *phases, "overlap", "MB", "GB/s", *(["max |dlogp|"] if drift else [])]
    return align(header, ([str(m.version), m.role, str(m.rank), *(f"{m.phases[p]:.4f}" for p in phases),
                           f"{m.overlap_s:.4f}", f"{m.bytes / 2**20:.2f}", f"{m.gbps:.3f}",
                           *([_worst_drift(m)] if drift else [])] for m in rows))


def _worst_drift(m: SyncMetrics) -> str:
    worst = max((d["max"] for d in m.drift.values()), default=None)
    return "-" if worst is None else f"{worst:.2e}"
