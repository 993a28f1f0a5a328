"""Draw one sync's timeline: one lane per (rank, phase), one bar per event (a gather unit or a bucket),
neighbouring events told apart by shade; wire bars carry their bucket index.

An engine's wire bar runs from posting the receive to the bucket's arrival, so it includes waiting
for the sender."""

from __future__ import annotations

from typing import Sequence

# (label of the rank, events [[phase, item, start, end], ...] in wall-clock seconds)
RankEvents = tuple[str, list]

PHASE_COLORS = {
    "gather": "#4c72b0", "convert": "#55a868", "pack": "#8172b2", "checksum": "#c44e52",
    "wire": "#dd8452", "verify": "#c44e52", "stage": "#55a868", "load": "#937860", "commit": "#8c8c8c",
}


def _shade(hex_color: str, darker: bool) -> str:
    if not darker:
        return hex_color
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(int(c * 0.6) for c in (r, g, b)))


def lanes_of(ranks: Sequence[RankEvents], order: Sequence[str]) -> list[tuple[str, str, list]]:
    """Return [(lane label, phase, events)] in rank order, phases in `order`, empty lanes dropped."""
    lanes = []
    for label, events in ranks:
        for phase in order:
            mine = [e for e in events if e[0] == phase]
            if mine:
                lanes.append((f"{label} {phase}", phase, mine))
    return lanes


def draw_timeline(path: str, ranks: Sequence[RankEvents], title: str,
                  order: Sequence[str] = ("gather", "convert", "checksum", "wire", "verify", "stage", "load",
                                          "commit")) -> None:
    """Write a PNG of the events of one sync to `path` (x: seconds since its first event)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = lanes_of(ranks, order)
    # The sync starts when the first rank (the stage source) starts it; ranks that entered earlier
    # (a trainer rank waiting in its first gather) are clipped there.
    origin = min(e[2] for e in ranks[0][1])
    lanes = [(label, phase, [[p, i, max(s, origin), t] for p, i, s, t in events if t > origin])
             for label, phase, events in lanes]
    end = max(e[3] for _, _, events in lanes for e in events) - origin
    fig, ax = plt.subplots(figsize=(14, 0.42 * len(lanes) + 1.6))
    for row, (_, phase, events) in enumerate(reversed(lanes)):
        spans = [(e[2] - origin, max(e[3] - e[2], end * 1e-4)) for e in events]
        colors = [_shade(PHASE_COLORS[phase], e[1] % 2 == 1) for e in events]  # neighbours stand apart
        ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=colors, linewidth=0)
        if phase == "wire":
            for e, (x, w) in zip(events, spans):
                if w > end * 0.02:
                    ax.text(x + w / 2, row, str(e[1]), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _, _ in reversed(lanes)], fontsize=8)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds since the sync started")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
