"""Each sync's figures where users already look: a TensorBoard writer, a W&B run, or anything with `add_scalar`.

`log_sync(writer, metrics)` writes one rank's row of one sync: seconds per phase, bytes, GB/s and the version
(step = the version), and on the trainer's leader the canary's drift per engine. A writer with `add_scalar(tag,
value, step)` (torch's and Megatron's TensorBoard `SummaryWriter`) gets one call per figure; one with
`log(dict, step=...)` (a W&B run) gets them in one call.
"""

from __future__ import annotations

from typing import Any

from megatron_sync.core.metrics import SyncMetrics

PREFIX = "weight_sync"


def sync_scalars(metrics: SyncMetrics) -> dict[str, float]:
    """Return the figures of one sync by tag."""
    scalars = {f"{PREFIX}/seconds/{phase}": seconds for phase, seconds in metrics.phases.items() if seconds}
    scalars.update({f"{PREFIX}/bytes": float(metrics.bytes), f"{PREFIX}/gbps": metrics.gbps,
                    f"{PREFIX}/version": float(metrics.version)})
    for engine, row in metrics.drift.items():
        scalars[f"{PREFIX}/drift_max/engine{engine}"] = row["max"]
        scalars[f"{PREFIX}/drift_mean/engine{engine}"] = row["mean"]
    return scalars


def log_sync(writer: Any, metrics: SyncMetrics) -> None:
    """Write `metrics` to `writer` at step `metrics.version` (see the module doc); a writer of neither kind is
    refused by name."""
    scalars = sync_scalars(metrics)
    if hasattr(writer, "add_scalar"):
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, metrics.version)
        if hasattr(writer, "flush"):
            writer.flush()
    elif hasattr(writer, "log"):
        writer.log(scalars, step=metrics.version)
    else:
        raise TypeError(f"a metrics writer needs add_scalar(tag, value, step) (TensorBoard) or log(dict, step=) "
                        f"(W&B); got {type(writer).__name__}")
