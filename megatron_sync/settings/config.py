"""User-facing weight-sync settings: one keyword-only, frozen, validated dataclass.

Loaded from the `weight_sync:` section of a training YAML
(`WeightSyncConfig.from_yaml`) or from `--weight-sync-*` flags added to
Megatron's argument parser (`add_weight_sync_args` / `WeightSyncConfig.from_args`).
Configuration enters here, at the edge; nothing deeper reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from megatron_sync.core.checksum import CHECKSUMS
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.settings import registry

BACKENDS = ("gloo", "nccl", "auto")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INFLIGHT_POLICIES = ("abort", "wait", "recompute", "keep")
DRAFT_CHOICES = ("sync", "skip")
SGLANG_LOADS = ("distributed", "tensor")  # megatron_sync.transports.sglang.delivery
P2P_BACKENDS = ("torch", "mooncake")  # megatron_sync.transports.p2p.transport.MOVERS
P2P_PROTOCOLS = ("tcp", "rdma")
CHECKSUM_CHOICES = ("auto", *CHECKSUMS)
DEFAULT_GATHER_BUDGET_MB = 1024.0

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


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """Settings of one weight-sync job; every field is checked in `__post_init__`."""

    enabled: bool = True
    """Turn weight sync on. When False the trainer never opens the transport."""

    every_n_steps: int = 1
    """Sync after every N-th *optimizer update* (a completed optimizer.step()).
    This counts updates, not rollout iterations: with several optimizer updates
    per rollout batch, a rollout iteration advances this counter several times."""

    transport: str = "broadcast"
    """How bytes move: a name registered in `megatron_sync.transports` ("broadcast"; "p2p": every trainer
    rank sends its own share, with the p2p_* settings below; "disk_delta": through shared storage,
    with the delta_* settings below; "ipc": trainer and engines on one host, through shared memory), or
    "auto": the trainer picks the transport and bucket size the
    scale model predicts fastest for its layouts on `hardware_profile` (megatron_sync.scale.auto), logs
    the choice and the prediction, and an inference job with "auto" adopts the trainer's choice."""

    hardware_profile: Optional[str] = None
    """The node type the jobs run on, for transport "auto": a profile of megatron_sync.scale.hardware
    ("h100", "h200", "gb200", ...; "local": this machine's measured rates). Required by a trainer with
    transport "auto"; an unknown name is refused with the list."""

    backend: str = "auto"
    """Collective backend of the transport group: "gloo", "nccl", or "auto"
    (nccl when CUDA is available, else gloo)."""

    master_address: str = "127.0.0.1"
    """Host of the TCP rendezvous store (the stage-0 source rank hosts it)."""

    master_port: int = 29600
    """Port of the TCP rendezvous store; must differ from the training job's MASTER_PORT."""

    num_inference_ranks: int = 1
    """Total inference ranks across all engines that join the transport group."""

    engine_tp_size: int = 1
    """Tensor-parallel size of each engine; must divide num_inference_ranks."""

    bucket_size_mb: float = 512.0
    """Upper bound of one transfer bucket in MiB (a larger single tensor gets its own bucket)."""

    gather_budget_mb: float = DEFAULT_GATHER_BUDGET_MB
    """Peak extra device memory the gather step may hold, in MiB."""

    timeout_s: float = 300.0
    """Seconds any collective of the transport group may wait before peers count as failed."""

    family: Optional[str] = None
    """Model family whose conversion rules apply (a family registered in megatron_sync.convert/, e.g. "qwen3").
    Required on the trainer side; there is no default, so a forgotten family is an error, not a guess."""

    hf_config_path: Optional[str] = None
    """The inference model's HF config.json, which every converted shape is checked against. The
    trainer needs an HF config: this path, or `hf_config=` passed to `WeightSyncCallback.from_config`
    / `TrainerWeightSync` (which then wins); without either it refuses to start."""

    dtype: str = "bfloat16"
    """Dtype the engine computes with; converted tensors are cast to it."""

    draft: str = "sync"
    """The multi-token-prediction draft layers (DeepSeek-V3, GLM-4.5): "sync" sends Megatron's MTP block as the
    draft layers the HF config declares (num_nextn_predict_layers), in the same version as the main weights;
    "skip" says the engines run without the draft: no draft layers are expected, and the MTP block's
    parameters are left out by name. Both jobs must agree (the plan handshake compares the tensor lists)."""

    metrics_path: Optional[str] = None
    """If set, each sync's metrics are appended to this file as one JSON line."""

    inflight_policy: str = "abort"
    """What happens to generations in flight at sync time: "abort" them, "wait" until they finish
    on the old weights (then the version goes live; bounded by timeout_s), "recompute" their KV
    cache under the new weights, or "keep" them going over their old KV cache (off-policy)."""

    engines: tuple[str, ...] = ()
    """Engines the trainer drives over their own HTTP API, each "KIND=URL" with KIND "vllm" or
    "sglang" (e.g. "vllm=http://10.0.0.7:8000"); their workers are the inference ranks, so
    num_inference_ranks must equal their worker count. Empty: the engines are megatron-sync
    inference jobs (launch/serve.sh) that follow the trainer's control messages."""

    run_id: Optional[str] = None
    """Identity of the sync session (letters, digits, '.', '_', '-'). The trainer hosts the session under
    this id, or under a generated one it prints when null; an inference job with a run_id joins only the
    session of that id, with null it joins whichever session the trainer at master_address:master_port runs."""

    sync_on_start: bool = False
    """Sync the trainer's weights once as `WeightSyncCallback.from_config` returns (version 1), before the
    first optimizer update: for engines that start without the trainer's current weights."""

    # ---- an elastic fleet of engines (see the README's "A fleet that keeps serving") ----

    fleet: bool = False
    """Engines join and leave the running session one by one: each engine is its own launched job (`engine_id`)
    with its own link to the trainer. An engine that fails or vanishes is dropped (one log line) and the sync goes
    on with the rest; a restarted or new engine joins at the next sync and gets the current version.
    num_inference_ranks is the initial fleet (the trainer waits up to timeout_s for it at start-up, then goes on
    with at least min_engines). Both jobs must agree. Transport "broadcast"."""

    engine_id: Optional[int] = None
    """Fleet, inference job: which engine this job is (0, 1, ...). A restarted engine presents its id again and
    replaces its earlier self; a new id joins as a new engine. Driven engines get their index in `engines`."""

    min_engines: int = 1
    """Fleet: the trainer fails, naming the engines gone, when fewer than this many engines remain."""

    wave_size: int = 0
    """Fleet: how many engines update at once (0: all). Engines outside the current wave keep serving the
    version they hold; every response says which version produced each token."""

    relay: bool = False
    """Fleet: an engine that committed a version sends it (its committed shards, rank to rank, checksummed) to
    an engine of the same layout in the next wave, so the trainer sends one copy per layout per version. A
    relay that fails falls back to the trainer."""

    max_staleness: int = 0
    """Fleet: 0: a sync returns once every wave committed. 1: it returns after the first wave, and the later
    waves update while the trainer trains on; the next sync first waits for them, so no engine serving is more
    than one version behind (each sync's metrics state the staleness)."""

    # ---- transport "disk_delta" (weights through shared storage; see the README's "Disk-delta transport") ----

    delta_dir: Optional[str] = None
    """The shared directory every trainer stage source and every inference host mounts (at this path):
    each stage's versions in stage-<s>/, control files in control/. Required with transport "disk_delta"."""

    delta_local_dir: Optional[str] = None
    """An inference host's own directory (a local disk) for its memory-mapped copy of the weights, which
    each version patches. Required with transport "disk_delta"."""

    delta_snapshot_every: int = 10
    """Every N-th version also carries a full snapshot (the first one always does), so a reader that
    missed versions, or holds nothing yet, needs at most N - 1 deltas after the newest snapshot."""

    delta_retention: int = 4
    """Keep the newest N versions (each with its chain back to a snapshot) plus what live readers need."""

    delta_encoding: str = "auto"
    """Per-chunk encoding: "auto" (a cheap heuristic), "best" (try all, keep the smallest) or one name of
    megatron_sync.transports.disk_delta.codec.CODECS ("xor_zstd" is the plain XOR + zstd baseline)."""

    delta_when_behind: str = "coalesce"
    """When the trainer syncs faster than versions are encoded: "coalesce" replaces the waiting version
    with the newer one (training never waits; engines skip to the newest), "block" makes sync() wait."""

    delta_queue_depth: int = 1
    """Versions that may wait for the encoder (host memory: queue_depth + 2 copies of a stage's weights)."""

    delta_encode_threads: int = 2
    """Threads encoding one version (zstd and numpy release the GIL)."""

    # ---- transport "sglang" (SGLang servers driven over their own update API) ----

    sglang_load: str = "distributed"
    """transport "sglang" only: how buckets reach the servers. "distributed": broadcast over SGLang's
    update group (/update_weights_from_distributed; any host); "tensor": CPU tensors handed over in
    shared memory (/update_weights_from_tensor; servers on the trainer's rank-0 host only)."""

    # ---- transport "p2p" (every trainer rank sends its share; see the README's "P2P transport") ----

    p2p_backend: str = "torch"
    """transport "p2p" only: what moves the bytes. "torch": point-to-point on the transport group
    (gloo on CPU, NCCL on GPU, as `backend` says); "mooncake": Mooncake Transfer Engine writes into
    each inference rank's registered staging memory (install mooncake-transfer-engine, or the
    -non-cuda build for TCP on CPU hosts, and the system library libibverbs1)."""

    p2p_protocol: str = "tcp"
    """p2p_backend "mooncake" only: "tcp", or "rdma" (refused when no RDMA device is visible,
    instead of Mooncake's silent fallback to TCP)."""

    p2p_device_name: str = ""
    """p2p_backend "mooncake" with "rdma": the RDMA devices to use, comma-separated (e.g. "mlx5_0,mlx5_1");
    empty: Mooncake picks."""

    p2p_local_hostname: Optional[str] = None
    """p2p_backend "mooncake": the address this process's transfer engine advertises to its peers;
    None: this host's name (socket.gethostname()). Use "127.0.0.1" when every rank runs on one host."""

    checksum: str = "auto"
    """Integrity check of every bucket: "xxh3" (host bytes, memory speed), "crc32" (host bytes,
    ~2 GB/s), "fletcher" (computed by torch where the bytes are, so on the GPU for NCCL buckets),
    "none" (trust the transport: NCCL over NVLink/InfiniBand has link-level CRC), or "auto":
    xxh3 for host buckets (gloo), fletcher for device buckets (NCCL). The sender computes it while
    the bucket is on the wire; a mismatch aborts the sync on every rank. All ranks must agree."""

    def __post_init__(self) -> None:
        _check_bool("enabled", self.enabled)
        _check_int("every_n_steps", self.every_n_steps, minimum=1)
        _check_choice("transport", self.transport, tuple(registry.names()))
        _check_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address must be a non-empty host name or IP, e.g. '10.0.0.1'")
        _check_int("master_port", self.master_port, minimum=1)
        if self.master_port > 65535:
            raise ValueError(f"master_port={self.master_port} is not a TCP port; use 1..65535")
        _check_int("num_inference_ranks", self.num_inference_ranks, minimum=1)
        _check_int("engine_tp_size", self.engine_tp_size, minimum=1)
        if self.num_inference_ranks % self.engine_tp_size:
            raise ValueError(
                f"engine_tp_size={self.engine_tp_size} must divide "
                f"num_inference_ranks={self.num_inference_ranks} (each engine spans engine_tp_size ranks)"
            )
        _check_positive("bucket_size_mb", self.bucket_size_mb)
        _check_positive("gather_budget_mb", self.gather_budget_mb)
        _check_positive("timeout_s", self.timeout_s)
        if self.family is not None and (not isinstance(self.family, str) or not self.family):
            raise ValueError("family must name a model family, e.g. 'qwen3' or 'deepseek_v3'")
        if self.hf_config_path is not None and not isinstance(self.hf_config_path, str):
            raise ValueError("hf_config_path must be a path string or null")
        try:
            dtype_from_name(self.dtype)
        except ValueError as e:
            raise ValueError(f"dtype: {e}") from None
        if self.metrics_path is not None and not isinstance(self.metrics_path, str):
            raise ValueError("metrics_path must be a file path string or null")
        _check_choice("inflight_policy", self.inflight_policy, INFLIGHT_POLICIES)
        _check_choice("draft", self.draft, DRAFT_CHOICES)
        _check_choice("checksum", self.checksum, CHECKSUM_CHOICES)
        if self.run_id is not None and (not isinstance(self.run_id, str) or not _RUN_ID.fullmatch(self.run_id)):
            raise ValueError(f"run_id={self.run_id!r} is not valid: use 1-64 letters, digits, '.', '_' or '-' "
                             "(or null to let the trainer name the session)")
        _check_bool("sync_on_start", self.sync_on_start)
        self._check_fleet()
        if isinstance(self.engines, str) or not isinstance(self.engines, (list, tuple)):
            raise ValueError(f"engines must be a list of KIND=URL entries, got {self.engines!r}")
        object.__setattr__(self, "engines", tuple(self.engines))  # YAML and flags give lists
        for entry in self.engines:
            parse_engine(entry)
        for name in ("delta_snapshot_every", "delta_retention", "delta_queue_depth", "delta_encode_threads"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.transport == "disk_delta":
            for name in ("delta_dir", "delta_local_dir"):
                if not isinstance(getattr(self, name), str) or not getattr(self, name):
                    raise ValueError(f"transport='disk_delta' needs {name}: " + (
                        "the shared directory both jobs mount, e.g. /shared/run42/weights" if name == "delta_dir"
                        else "a directory on each inference host's local disk, e.g. /local/megatron_sync"))
        sglang = [e for e in self.engines if parse_engine(e)[0] == "sglang"]
        if self.transport == "p2p" and sglang:
            raise ValueError(f"transport 'p2p' writes each rank's shard into its staging memory, which SGLang's "
                             f"update API does not expose (engines {sglang}); use transport 'sglang' for SGLang, "
                             "or 'p2p' with megatron-sync inference ranks and vLLM servers")
        if self.transport == "ipc" and sglang:
            raise ValueError(f"transport 'ipc' hands buckets to megatron-sync receivers in shared memory, which "
                             f"SGLang's update API does not run (engines {sglang}); use transport 'sglang' for "
                             "SGLang, or 'ipc' with megatron-sync inference ranks and vLLM servers")
        _check_choice("sglang_load", self.sglang_load, SGLANG_LOADS)
        if self.sglang_load != "distributed" and self.transport != "sglang":
            raise ValueError(f"sglang_load={self.sglang_load!r} applies to transport 'sglang' only; drop it or set "
                             "transport: sglang")
        _check_choice("p2p_backend", self.p2p_backend, P2P_BACKENDS)
        _check_choice("p2p_protocol", self.p2p_protocol, P2P_PROTOCOLS)
        if not isinstance(self.p2p_device_name, str):
            raise ValueError("p2p_device_name must be a string of RDMA device names, e.g. 'mlx5_0,mlx5_1' (or '')")
        if self.p2p_local_hostname is not None and (not isinstance(self.p2p_local_hostname, str)
                                                    or not self.p2p_local_hostname):
            raise ValueError("p2p_local_hostname must be a host name or IP this rank is reachable at, or null")
        registry.check(self)  # last: the chosen transport's own settings (disk_delta's writer, auto's profile)

    def _check_fleet(self) -> None:
        _check_bool("fleet", self.fleet)
        _check_bool("relay", self.relay)
        _check_int("min_engines", self.min_engines, minimum=1)
        _check_int("wave_size", self.wave_size, minimum=0)
        _check_int("max_staleness", self.max_staleness, minimum=0)
        if self.max_staleness > 1:
            raise ValueError(f"max_staleness={self.max_staleness} is not supported; use 0 (every wave before "
                             "sync() returns) or 1 (later waves while training goes on)")
        if self.engine_id is not None:
            _check_int("engine_id", self.engine_id, minimum=0)
        if not self.fleet:
            changed = [name for name, default in (("engine_id", None), ("min_engines", 1), ("wave_size", 0),
                                                  ("relay", False), ("max_staleness", 0))
                       if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{changed} apply to a fleet of engines only; set fleet: true (each engine its "
                                 "own job with its engine_id), or drop them")
            return
        if self.transport != "broadcast":
            raise ValueError(f"fleet: true runs over transport 'broadcast' (one link per engine, rebuilt as "
                             f"engines come and go); transport {self.transport!r} is not elastic yet")
        if self.min_engines > self.num_engines and not self.engines:
            raise ValueError(f"min_engines={self.min_engines} is more than the initial fleet of {self.num_engines} "
                             f"engine(s) (num_inference_ranks / engine_tp_size); lower min_engines")

    def replace(self, **changes: Any) -> "WeightSyncConfig":
        """Return a copy with `changes` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    def require_family(self) -> str:
        """Return `family`, or raise ValueError saying where to set it."""
        if self.family is None:
            raise ValueError(
                "weight_sync.family is not set: name the model family being trained (e.g. family: qwen3 "
                "in the weight_sync: section, or --weight-sync-family qwen3)"
            )
        return self.family

    @property
    def bucket_size_bytes(self) -> int:
        """Return the bucket bound in bytes."""
        return int(self.bucket_size_mb * 1024 * 1024)

    @property
    def num_engines(self) -> int:
        """Return how many engines the inference ranks form."""
        return self.num_inference_ranks // self.engine_tp_size

    def resolved_backend(self, cuda_available: bool) -> str:
        """Return "gloo" or "nccl", resolving "auto" by whether CUDA is available."""
        if self.backend == "auto":
            return "nccl" if cuda_available else "gloo"
        return self.backend

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "WeightSyncConfig":
        """Return a config from a mapping; unknown keys raise ValueError listing the valid ones."""
        valid = field_names()
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown weight_sync keys {unknown}; valid keys are {list(valid)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str, defaults: Optional[dict[str, Any]] = None) -> "WeightSyncConfig":
        """Return the config in the `weight_sync:` section of the training YAML at `path`.

        `defaults` (an application's own, stated in its code) apply where the
        section does not set a key. Nothing else is filled in: a section without
        `family` leaves it None, and the trainer refuses to start saying where
        to set it.
        """
        import yaml

        with open(path) as f:
            document = yaml.safe_load(f) or {}
        if not isinstance(document, dict) or "weight_sync" not in document:
            raise ValueError(f"{path}: no 'weight_sync:' section; add one (it may be empty: 'weight_sync: {{}}')")
        section = document["weight_sync"] or {}
        if not isinstance(section, dict):
            raise ValueError(f"{path}: 'weight_sync' must be a mapping of settings")
        return cls.from_dict({**(defaults or {}), **section})

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> "WeightSyncConfig":
        """Return the config from a namespace parsed with `add_weight_sync_args` flags."""
        return cls(**{name: getattr(namespace, f"weight_sync_{name}") for name in field_names()})


def explicit_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """Return the `--weight-sync-*` values given on the command line, by field name.

    Needs a parser whose weight-sync defaults are None (`add_weight_sync_args(parser, defaults=False)`),
    so that flags override a YAML section only where given.
    """
    return {name: getattr(namespace, f"weight_sync_{name}") for name in field_names()
            if getattr(namespace, f"weight_sync_{name}") is not None}


def field_names() -> tuple[str, ...]:
    """Return the names of WeightSyncConfig's fields in declaration order."""
    return tuple(f.name for f in dataclasses.fields(WeightSyncConfig))


def add_weight_sync_args(parser: argparse.ArgumentParser, *, defaults: bool = True) -> argparse.ArgumentParser:
    """Add `--weight-sync-*` flags to `parser` and return it (Megatron's extra_args_provider).

    With `defaults=False` unset flags stay None, for jobs whose YAML supplies the rest.
    """
    group = parser.add_argument_group("weight sync")
    for field in dataclasses.fields(WeightSyncConfig):
        flag = "--weight-sync-" + field.name.replace("_", "-")
        default = field.default if defaults else None
        kwargs: dict[str, Any] = {"dest": f"weight_sync_{field.name}", "default": default}
        if field.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.type in ("int", int, "Optional[int]"):
            kwargs["type"] = int
        elif field.type in ("float", float):
            kwargs["type"] = float
        elif str(field.type).startswith("tuple"):
            kwargs.update(type=str, nargs="*")
        else:
            kwargs["type"] = str
        group.add_argument(flag, **kwargs)
    return parser


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; use one of {list(choices)}")
