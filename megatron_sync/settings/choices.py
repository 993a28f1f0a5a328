"""The settings' vocabulary: the values each choice field accepts, and the `engines` entries' grammar."""

from __future__ import annotations

import re
from typing import Callable, Union

from megatron_sync.core.checksum import CHECKSUMS
from megatron_sync.settings import registry

BACKENDS = ("gloo", "nccl", "auto")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INFLIGHT_POLICIES = ("abort", "wait", "recompute", "keep")
DRAFT_CHOICES = ("sync", "skip")
P2P_BACKENDS = ("nixl", "mooncake", "torch")  # megatron_sync.transports.p2p.transport.MOVERS
P2P_PROTOCOLS = ("tcp", "rdma")
SGLANG_LOADS = ("distributed", "tensor")  # megatron_sync.transports.sglang.delivery
CHECKSUM_CHOICES = ("auto", *CHECKSUMS)
DEFAULT_GATHER_BUDGET_MB = 1024.0
DRIFT_ACTIONS = ("fail", "warn")

ENGINE_CLIENTS = {
    "vllm": "megatron_sync.engines.vllm.client:VLLMEngineClient",
    "sglang": "megatron_sync.engines.sglang.client:SGLangEngineClient",
}
"""Kinds of `weight_sync.engines` entries -> the EngineClient class driving that engine (import paths)."""


def parse_engine(entry: str) -> tuple[str, str]:
    """Return (kind, url) of one `weight_sync.engines` entry "KIND=URL"; ValueError names the fix."""
    kind, sep, url = entry.partition("=") if isinstance(entry, str) else ("", "", "")
    if not sep or kind not in ENGINE_CLIENTS or not url.startswith(("http://", "https://")):
        raise ValueError(
            f"engines entry {entry!r} is not KIND=URL with KIND one of {sorted(ENGINE_CLIENTS)} and an "
            "http(s) URL, e.g. 'vllm=http://10.0.0.7:8000'"
        )
    return kind, url


FIELD_CHOICES: dict[str, Union[tuple[str, ...], Callable[[], list[str]]]] = {
    "transport": registry.names,  # filled from above: the built-in transports, then any register_transport
    "backend": BACKENDS,
    "inflight_policy": INFLIGHT_POLICIES,
    "draft": DRAFT_CHOICES,
    "checksum": CHECKSUM_CHOICES,
    "p2p_backend": P2P_BACKENDS,
    "p2p_protocol": P2P_PROTOCOLS,
    "on_drift": DRIFT_ACTIONS,
    "sglang_load": SGLANG_LOADS,
}
"""Settings that take one of a fixed set of values -> that set (a callable where it is registered at run time).
Validation checks these very objects (settings/checks.py); the settings reference (docs/hooks/settings_page.py)
lists them."""
