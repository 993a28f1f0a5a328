"""The settings check of transport "ipc" (run when a config chooses it; see megatron_sync.settings.registry)."""

from __future__ import annotations

from typing import Any


def check_settings(config: Any) -> None:
    """Refuse `backend: nccl` where CUDA is absent: ipc hands over device memory only when the GPUs are there."""
    import torch

    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("transport 'ipc' with backend 'nccl' hands CUDA memory between processes, and this machine "
                         "has no CUDA device; use backend 'auto' (shared host memory here, CUDA IPC on a GPU host) "
                         "or 'gloo'")
