"""Test support for the live SGLang tests: a real SGLang 0.5.23 server on CPU, asked over its own API.

The server runs from SGLang's own environment (`make setup` builds
`.venv-sglang` from requirements-sglang.txt; MEGATRON_SYNC_SGLANG_PYTHON
names another interpreter), started by launch/serve_sglang.sh with the
shims of `tests/support/sglang_shim` on PYTHONPATH: an import-only
`sgl_kernel` and the two torchvision schemas. `SGLangServer.stub_calls()`
lists every `[sgl_kernel stub] CALLED <name>` line of its log; the tests
fail when there is one (a kernel the CPU run needed was never there).
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.request
from typing import Any, Iterator, Optional

import torch

from tests.support.models import ModelSpec
from tests.support.real_engines import ROOT, HFReference, LaunchedServer, get, post, write_model_dir
from tests.support.scratch import scratch_folder
from tests.support.timing import scaled

SHIM = os.path.join(ROOT, "tests", "support", "sglang_shim")
STUB_CALLED = re.compile(r"\[sgl_kernel stub\] CALLED (\S+)")
SERVER_START_S = 240  # ~15 s on an idle 2-core machine (TP=2: ~25 s)


def sglang_python() -> str:
    """Return the interpreter of SGLang's environment; raise naming `make setup` when it is missing."""
    python = os.environ.get("MEGATRON_SYNC_SGLANG_PYTHON") or os.path.join(ROOT, ".venv-sglang", "bin", "python")
    if not os.path.exists(python):
        raise RuntimeError(f"no SGLang environment at {python}: run `make setup` (it builds .venv-sglang from "
                           "requirements-sglang.txt) or set MEGATRON_SYNC_SGLANG_PYTHON")
    return python


class SGLangServer(LaunchedServer):
    """An SGLang server subprocess (launch/serve_sglang.sh); `stop()` also ends its scheduler children."""

    name = "SGLang"

    def __init__(self, model_dir: str, *args: str, log_path: str, tp: int = 1, dtype: str = "float32",
                 port: Optional[int] = None) -> None:
        """`port`: where to listen (a restarted server takes its predecessor's; None: a free one)."""
        env = {**os.environ, "PYTHON": sglang_python(), "PYTHONPATH": SHIM, "HF_HUB_OFFLINE": "1",
               # one core per TP rank: SGLang's CPU engine asks for one NUMA node per rank otherwise
               "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % os.cpu_count()) for r in range(tp)),
               "TMPDIR": scratch_folder()}  # its IPC sockets, removed with the folder when the tests end
        # The KV cache holds --max-total-tokens (SGLang caps its profiled capacity there). On CPU SGLang profiles
        # the machine's free memory before and after loading and refuses to start when the difference exceeds
        # --mem-fraction-static of it; other tests' processes allocating meanwhile count as the model's, so the
        # fraction leaves room for them (0.05 failed a run when they took 7% during a load).
        command = [os.path.join(ROOT, "launch", "serve_sglang.sh"), model_dir, "--host", "127.0.0.1",
                   "--dtype", dtype, "--tp-size", str(tp), "--mem-fraction-static", "0.4",
                   "--max-total-tokens", "8192", "--skip-server-warmup",
                   # idle schedulers wait on their sockets instead of spinning a core each (2 cores here)
                   "--sleep-on-idle", *args]
        self._launch(command, env, log_path, port)

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> "SGLangServer":
        return super().wait_ready(timeout_s)

    def stub_calls(self) -> list[str]:
        """Return the names of the `sgl_kernel` stand-in's functions the server called (should be none)."""
        with open(self.log_path, errors="replace") as f:
            return STUB_CALLED.findall(f.read())


@contextlib.contextmanager
def serving(folder: str, spec: ModelSpec, *args: str, tp: int = 1, seed: int = 0
            ) -> Iterator[tuple[SGLangServer, dict[str, torch.Tensor]]]:
    """Write `spec`'s model directory (reference weights of `seed`) in `folder` and serve it (fp32); yield
    (the ready server, the directory's tensors); the server stops after."""
    model_dir = os.path.join(folder, "model")
    tensors = write_model_dir(model_dir, spec, seed=seed)
    server = SGLangServer(model_dir, *args, log_path=os.path.join(folder, "server.log"), tp=tp)
    try:
        server.wait_ready()
        yield server, tensors
    finally:
        server.stop()


# ---------------------------------------------------------------- asking the server


def generate(url: str, prompt: list[int], max_tokens: int = 8, **sampling: Any) -> dict:
    """Return SGLang's /generate answer for token ids `prompt` (greedy): output_ids, meta_info."""
    params = {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True, **sampling}
    return post(url, "/generate", {"input_ids": prompt, "sampling_params": params}, timeout_s=120)


def greedy(url: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """Return the server's greedy tokens for `prompt`."""
    return list(generate(url, prompt, max_tokens)["output_ids"])


def weight_version(url: str) -> str:
    """Return the weight version the server reports on /model_info."""
    return get(url, "/model_info")["weight_version"]


def serving_problems(url: str, reference: HFReference, prompts: list[list[int]],
                     version: Optional[str] = None) -> list[str]:
    """Return how the server's greedy tokens differ from `reference`'s, and the version it reports on each
    answer and on /model_info when it is not `version` (none: [])."""
    problems = []
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    answers = post(url, "/generate", {"input_ids": prompts, "sampling_params": params}, timeout_s=120)  # one batch
    for prompt, answer in zip(prompts, answers, strict=True):
        problem = reference.check(list(answer["output_ids"]), prompt)
        if problem:
            problems.append(f"prompt {prompt}: {problem}")
        if version is not None and answer["meta_info"].get("weight_version") != version:
            problems.append(f"prompt {prompt}: answered with weight_version "
                            f"{answer['meta_info'].get('weight_version')!r}, not {version!r}")
    if version is not None and weight_version(url) != version:
        problems.append(f"/model_info reports weight_version {weight_version(url)!r}, not {version!r}")
    return problems


class StreamedGeneration:
    """A long greedy generation streamed from SGLang's /generate on a thread.

    `first_tokens` is set once tokens arrived; `result()` returns (output ids, finish reason type, the
    weight version the last chunk reports).
    """

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        import threading

        self.first_tokens = threading.Event()
        self.last: dict = {}
        self._error: Optional[BaseException] = None
        body = {"input_ids": prompt, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        import json

        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=600) as answer:
                for raw in answer:
                    line = raw.decode().strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        self.last = json.loads(line[5:])
                        if self.last.get("output_ids"):
                            self.first_tokens.set()
        except BaseException as e:  # noqa: BLE001 — surfaced by result()
            self._error = e
        finally:
            self.first_tokens.set()

    def result(self, timeout_s: float = 300) -> tuple[list[int], Optional[str], Optional[str]]:
        """Wait for the stream to end; return (output ids, finish reason type, reported weight version)."""
        self._thread.join(scaled(timeout_s))
        assert not self._thread.is_alive(), f"the streamed generation did not end within {scaled(timeout_s):g}s"
        if self._error is not None:
            raise self._error
        meta = self.last.get("meta_info", {})
        return list(self.last.get("output_ids", [])), (meta.get("finish_reason") or {}).get("type"), \
            meta.get("weight_version")
