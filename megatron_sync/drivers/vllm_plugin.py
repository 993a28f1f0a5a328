"""vLLM general plugin: makes backend "megatron_sync" known to vLLM in every vLLM process.

Registered in pyproject.toml under the entry-point group `vllm.general_plugins`,
which vLLM loads in its API server, engine core and worker processes. The
engine class itself is imported only when vLLM creates it (a worker started
with --weight-transfer-config '{"backend": "megatron_sync"}').
"""

from __future__ import annotations

from megatron_sync.engines.vllm.wire import BACKEND


def register() -> None:
    """Register the "megatron_sync" weight-transfer backend with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megatron_sync.drivers.vllm_worker", "MegatronSyncTransferEngine"
        )
    except ValueError:
        pass  # vLLM may load general plugins more than once per process; the first registration stands
