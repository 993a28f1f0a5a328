"""Test-only vLLM plugin: makes one worker's load of one version fail halfway, or leave one parameter
changed, armed through a file.

The vLLM tests register it next to the real plugin (tests/support/real_engines.plugin_path)
and start the server with MEGATRON_SYNC_TEST_FAULTS=<file>. Writing
{"version": v, "worker": w} into the file makes worker w's load of version v
raise after vLLM consumed half of the tensors, so the real restore path runs;
{"version": v, "worker": w, "corrupt": name} lets the load succeed, then flips one
byte of vLLM's parameter `name` (a fault no wire checksum sees: the post-load check must).
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
        fault = _armed(path) or {}
        if {k: fault.get(k) for k in ("version", "worker")} != {"version": version, "worker": self.worker_rank}:
            return original(self, shards, version)
        if "corrupt" not in fault:
            shards = _FailingHalfway(shards, f"injected load failure on worker {self.worker_rank} at version {version}")
            return original(self, shards, version)
        original(self, shards, version)
        import torch

        with torch.no_grad():
            self.model.get_parameter(fault["corrupt"]).data.view(-1).view(torch.uint8)[0] ^= 0x01

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
