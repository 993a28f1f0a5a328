"""One scratch folder per test process for what servers leave behind.

vLLM names the ZMQ sockets its processes meet on under `VLLM_RPC_BASE_PATH` (default: /tmp) and never removes
them, and SGLang names its IPC sockets with `tempfile` (under TMPDIR), so every server a run starts used to
leave a few sockets in /tmp. Each test process (each xdist worker) points the variable at a short folder of
its own, which every vLLM process it starts inherits, hands the same folder to the SGLang servers it starts as
their TMPDIR (`scratch_folder`), and removes the folder when it ends. (A socket's path must fit in 107 bytes,
hence a short folder in the temp dir rather than pytest's own.)
"""

from __future__ import annotations

import os
import shutil
import tempfile

_FOLDER: list[str] = []


def pytest_configure(config) -> None:
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        _FOLDER.append(tempfile.mkdtemp(prefix="msync-rpc-"))
        os.environ["VLLM_RPC_BASE_PATH"] = _FOLDER[0]


def pytest_unconfigure(config) -> None:
    for folder in _FOLDER:
        shutil.rmtree(folder, ignore_errors=True)


def scratch_folder() -> str:
    """Return this test process's scratch folder (the temp dir where the plugin made none)."""
    return _FOLDER[0] if _FOLDER else os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir())
