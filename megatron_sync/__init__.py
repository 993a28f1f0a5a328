"""megatron-sync: move freshly trained Megatron weights into inference engines during RL post-training.

The public API (everything else is internal):

Trainer side
    WeightSyncConfig      the settings (`weight_sync:` in a YAML, `--weight-sync-*` flags, or keyword arguments)
    WeightSyncCallback    the hook a Megatron training loop calls after each optimizer step (syncs every N)
    TrainerWeightSync     the trainer half itself, for loops that sync on their own schedule

Inference side
    InferenceWeightSync   the receiving half on one inference rank: joins the session, applies every version
    join                  start an inference job's rank from its settings: the engine, its group, its rank
    ReferenceEngine       the project's own engine (a transformers model sharded over its TP ranks)
    EngineAdapter         what an engine implements to receive versions (shards in, version out)

What a sync reports
    SyncMetrics           per rank and version: phases, bytes, the fleet's rows, the canary's drift
    SyncError             the base of every error a sync raises (PeerFailureError, SyncAbortedError,
                          RendezvousError, PlanMismatchError, CorruptBucketError, DriftError, ...)

vLLM loads `megatron_sync.drivers.vllm_plugin` by itself (an entry point); SGLang is driven over its HTTP API.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

import megatron_sync.transports  # noqa: F401  fills the settings' registry of transport names (imports no transport)

_WHERE = {
    "WeightSyncConfig": "megatron_sync.settings.config",
    "WeightSyncCallback": "megatron_sync.drivers.callback",
    "TrainerWeightSync": "megatron_sync.drivers.sync",
    "InferenceWeightSync": "megatron_sync.drivers.inference_sync",
    "join": "megatron_sync.drivers.serve",
    "ReferenceEngine": "megatron_sync.engines.reference.engine",
    "EngineAdapter": "megatron_sync.engines.base",
    "SyncMetrics": "megatron_sync.core.metrics",
    "SyncError": "megatron_sync.core.errors",
    "PeerFailureError": "megatron_sync.core.errors",
    "SyncAbortedError": "megatron_sync.core.errors",
    "RendezvousError": "megatron_sync.core.errors",
    "PlanMismatchError": "megatron_sync.core.errors",
    "CorruptBucketError": "megatron_sync.core.errors",
    "DriftError": "megatron_sync.core.errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import a public name on first use (`import megatron_sync` stays light: vLLM imports it in every process)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'megatron_sync' has no attribute {name!r}; the public API is {__all__}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
