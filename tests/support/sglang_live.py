"""A live SGLang server on a GPU receives two versions from a Megatron trainer over transport "sglang".

Used by the gpu-marked test in tests/test_sglang_protocol.py. Starts
`python -m sglang.launch_server` on a tiny Qwen3 (fp32) written by the test,
syncs two versions with `TrainerWeightSync` (weight_sync.transport: sglang,
engines: [sglang=URL], backend nccl), and compares SGLang's greedy tokens with
transformers' on the tensors sent, plus the version on /model_info and on
each response.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from tests.support.dist import free_port
from tests.support.real_engines import QWEN3, HFReference, TrainerProcess, get, post, write_model_dir

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8]]


def _start(model_dir: str, port: int, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
               "--host", "127.0.0.1", "--dtype", "float32", "--mem-fraction-static", "0.3"]
    log = open(log_path, "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("SGLang did not become healthy")


def _greedy(url: str, prompt: list[int]) -> tuple[list[int], str]:
    answer = post(url, "/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    return answer["output_ids"], answer["meta_info"]["weight_version"]


def run_live_sync() -> dict:
    """Return {"versions": reported after each sync, "problems": token or version mismatches}."""
    folder = tempfile.mkdtemp(prefix="sglang_live_")
    write_model_dir(os.path.join(folder, "model"), QWEN3, seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(os.path.join(folder, "model"), port, os.path.join(folder, "server.log"))
    trainer = TrainerProcess(QWEN3)
    versions, problems = [], []
    try:
        _wait(url, proc)
        trainer.load(1)
        trainer.connect(family="qwen3", dtype="float32", master_port=free_port(), num_inference_ranks=1,
                        bucket_size_mb=0.05, timeout_s=120, backend="nccl", transport="sglang",
                        engines=[f"sglang={url}"])
        for seed in (1, 2):
            trainer.load(seed)
            version = trainer.sync()
            reference = HFReference(QWEN3, trainer.sent())
            for prompt in PROMPTS:
                tokens, reported = _greedy(url, prompt)
                problem = reference.check(tokens, prompt)
                if problem or reported != str(version):
                    problems.append(f"version {version} prompt {prompt}: {problem} (reported {reported})")
            versions.append(get(url, "/model_info")["weight_version"])
        trainer.disconnect()
    finally:
        trainer.stop()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return {"versions": versions, "problems": problems}
