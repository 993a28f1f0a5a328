"""Test-only vLLM plugin: makes one worker's load of one version fail halfway, armed through a file.

The vLLM tests register it next to the real plugin (tests/support/real_engines.plugin_path)
and start the server with MEGATRON_SYNC_TEST_FAULTS=<file>. Writing
{"version": v, "worker": w} into the file makes worker w's load of version v
raise after vLLM consumed half of the tensors, so the real restore path runs.
"""

from __future__ import annotations

import json
import os


def register() -> None:
    """Wrap VLLMModelAdapter.load_shards in this process when the fault file is configured."""
    path = os.environ.get("MEGATRON_SYNC_TEST_FAULTS")
    if not path:
        return
    from megatron_sync.engines.vllm import adapter

    original = adapter.VLLMModelAdapter.load_shards
    if getattr(original, "_fault_wrapped", False):
        return

    def load_shards(self, shards, version):
        fault = _armed(path)
        if fault == {"version": version, "worker": self.worker_rank}:
            shards = _FailingHalfway(shards, f"injected load failure on worker {self.worker_rank} at version {version}")
        return original(self, shards, version)

    load_shards._fault_wrapped = True
    adapter.VLLMModelAdapter.load_shards = load_shards


def _armed(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class _FailingHalfway:
    """Yields the first half of the tensors, then raises (vLLM has processed some layers by then)."""

    def __init__(self, shards, message: str) -> None:
        self._shards, self._message = shards, message

    def items(self):
        items = list(self._shards.items())
        yield from items[: len(items) // 2]
        raise RuntimeError(self._message)
