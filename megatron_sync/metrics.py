"""Per-sync measurements: phase times, bytes, throughput, overlap; JSON lines and a table."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

PHASES = ("gather", "convert", "pack", "transfer", "apply", "commit", "total")


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
    overlap_s: float = 0.0
    num_buckets: int = 0

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase`."""
        assert phase in self.phases, phase
        self.phases[phase] += seconds

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
        }, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "SyncMetrics":
        """Return the metrics that `to_json()` described (for rows gathered from other ranks)."""
        d = json.loads(line)
        return cls(
            d["version"], role=d["role"], rank=d["rank"], phases=dict(d["phases_s"]),
            bytes=d["bytes"], overlap_s=d["overlap_s"], num_buckets=d["num_buckets"],
        )

    def append_to(self, path: Optional[str]) -> None:
        """Append `to_json()` as a line to `path` (no-op when path is None)."""
        if path:
            with open(path, "a") as f:
                f.write(self.to_json() + "\n")


class PhaseTimer:
    """Context manager: on exit, adds the elapsed wall time to a phase of a SyncMetrics."""

    def __init__(self, metrics: Optional[SyncMetrics], phase: str) -> None:
        self.metrics, self.phase = metrics, phase
        self.elapsed = 0.0

    def __enter__(self) -> "PhaseTimer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.elapsed = time.perf_counter() - self._start
        if self.metrics is not None:
            self.metrics.add(self.phase, self.elapsed)


def format_table(rows: Iterable[SyncMetrics]) -> str:
    """Return an aligned text table: one row per sync, one column per phase (seconds)."""
    header = ["version", "role", "rank", *PHASES, "overlap", "MB", "GB/s"]
    lines = [header]
    for m in rows:
        lines.append([
            str(m.version), m.role, str(m.rank),
            *(f"{m.phases[p]:.4f}" for p in PHASES),
            f"{m.overlap_s:.4f}", f"{m.bytes / 2**20:.2f}", f"{m.gbps:.3f}",
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)
