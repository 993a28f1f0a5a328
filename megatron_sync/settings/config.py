"""User-facing weight-sync settings: one keyword-only, frozen, validated dataclass.

Loaded from the `weight_sync:` section of a training YAML
(`WeightSyncConfig.from_yaml`) or from `--weight-sync-*` flags added to
Megatron's argument parser (`add_weight_sync_args` / `WeightSyncConfig.from_args`).
Configuration enters here, at the edge; nothing deeper reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from megatron_sync.settings import checks, registry  # checks: the validations
from megatron_sync.settings.choices import (  # noqa: F401 — re-exported: the settings' vocabulary
    BACKENDS, CHECKSUM_CHOICES, DEFAULT_GATHER_BUDGET_MB, DRAFT_CHOICES, DRIFT_ACTIONS, ENGINE_CLIENTS, FIELD_CHOICES,
    INFLIGHT_POLICIES, P2P_BACKENDS, P2P_PROTOCOLS, SGLANG_LOADS, parse_engine,
)
from megatron_sync.settings.sections import deprecated_flag, flag, inert_section_problem, present_sections, sectioned


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
    """Engines join and leave the running session one by one: each engine is its own launched job (`fleet.engine_id`)
    with its own link to the trainer. An engine that fails or vanishes is dropped (one log line) and the sync goes
    on with the rest; a restarted or new engine joins at the next sync and gets the current version.
    num_inference_ranks is the initial fleet (the trainer waits up to timeout_s for it at start-up, then goes on
    with at least fleet.min_engines). Both jobs must agree. Transport "broadcast" or "p2p"; or "sglang", where the
    engines are the SGLang servers of `engines`: one that fails a version or stops answering leaves the fleet and
    the others commit it; one that answers again rejoins at the next sync and gets that version."""

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
    relay that fails falls back to the trainer. With fleet.wave_size 0 the relay makes the waves itself: the
    first engine of each layout gets the trainer's copy, the others take it relayed in the waves after."""

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
    """transport "p2p" only: what moves the bytes. "nixl": NIXL (UCX) writes from each trainer rank's
    registered arena into each inference rank's registered window, GPU memory to GPU memory over RDMA where
    the NICs allow (install nixl-cu12; on a host without RDMA set UCX_TLS=tcp); "mooncake": Mooncake
    Transfer Engine's one-sided writes between the same buffers (install mooncake-transfer-engine, or the
    -non-cuda build for TCP on CPU hosts, and the system library libibverbs1); "torch": point-to-point on
    the transport group (gloo on CPU, NCCL on GPU, as `backend` says)."""

    p2p_protocol: str = "tcp"
    """p2p.backend "mooncake" only: "tcp", or "rdma" (refused when no RDMA device is visible)."""

    p2p_device_name: str = ""
    """p2p.backend "mooncake" with "rdma": RDMA devices, comma-separated ("mlx5_0,mlx5_1"); empty: Mooncake picks."""

    p2p_nixl_wake_ms: float = 1.0
    """p2p.backend "nixl", inference ranks: NIXL's progress thread sleeps on UCX's events and wakes at least
    this often (ms, rounded up). 0: it polls without pause, a core per rank taken from generation."""

    p2p_local_hostname: Optional[str] = None
    """p2p.backend "mooncake": the address this process's transfer engine advertises to its peers;
    None: this host's name (socket.gethostname()). Use "127.0.0.1" when every rank runs on one host."""

    p2p_arena_mb: float = 0.0
    """transport "p2p": the size of each trainer rank's registered arena its pieces are staged in (MiB);
    0: the rank's whole share of a version (registered once, reused by every version). A smaller arena is
    reused in rounds (a NIC that cannot register that much memory); it must hold one bucket."""

    p2p_window_mb: float = 0.0
    """transport "p2p": the size of each inference rank's registered receive window (MiB); 0: its staging
    set is the window (nothing is copied). A smaller window is written round by round, each round copied
    into the staging set before the next may land; it must hold one bucket. The trainer's value is used."""

    p2p_forward: bool = True
    """transport "p2p": engines whose rank layouts are identical form a chain: the trainer writes the first,
    each engine rank forwards every round to the same rank of the next, so the trainer sends one copy per
    layout however many engines there are. False: the trainer writes every engine. The trainer's value is used."""

    staging_sets: int | str = "auto"
    """Staging sets of its shard per engine rank (broadcast, ipc, p2p; over p2p the trainer's). 2: a version arrives
    in the set the engine does not run on; the other is the rollback source. 1: weights + 1 set, the rollback source
    a host copy of the live version taken between syncs. "auto": 1 for engines that copy every version into weights
    of their own (vLLM), else 2 (docs/transports/p2p.md, "Where a version waits")."""

    verify_every: int = 1
    """After an engine rank loaded a version, check that its params hold exactly what was sent, region by
    region (digests recorded from the verified bytes; drafts included): every version (1), every Nth (the
    first, then every N), or never (0). A mismatch fails the version on every rank of the engine, which stays
    on the previous one, naming the rank, param and region. Needs a checksum (not "none")."""

    metrics_port: int = 0
    """Inference side: serve each engine rank's per-version rows (version served, seconds per phase, bytes,
    syncs committed and aborted) in Prometheus's text format at http://HOST:(metrics_port + inference rank)/
    metrics; 0: none."""

    canary_length: int = 0
    """After every commit each engine scores a canary sequence of this many tokens (log p of each given those
    before it) and the trainer compares with its own Megatron forward: max and mean |Δ log p| per engine per
    version, in the trainer's metrics (`drift`) and table. 0: no canary."""

    canary_seed: int = 0
    """The seed the canary's token ids are drawn from the vocabulary with (the same on every rank and run)."""

    canary_tokens: tuple[int, ...] = ()
    """The canary's token ids, when you want your own (a prompt of your task); they replace the drawn ones."""

    max_logprob_drift: float = 0.0
    """The largest |Δ log p| an engine may show on the canary; 0: record the drift only. Past it, `on_drift`."""

    on_drift: str = "fail"
    """When an engine drifts past max_logprob_drift: "fail" (the trainer's sync raises DriftError naming the
    engine; the engine keeps the version: its bytes are exact, it computes differently) or "warn" (a log line)."""

    checksum: str = "auto"
    """Integrity check of every bucket: "xxh3" (host bytes, memory speed), "crc32" (host bytes,
    ~2 GB/s), "wsum64" (computed by torch where the bytes are, so on the GPU for device buckets),
    "none" (trust the transport: NCCL over NVLink/InfiniBand has link-level CRC), or "auto":
    xxh3 for host bytes (gloo, host staging), wsum64 for device bytes (NCCL, device arenas). The sender computes it while
    the bucket is on the wire; a mismatch aborts the sync on every rank. All ranks must agree."""

    def __post_init__(self) -> None:
        for check in checks.ALL:  # each names the field and the fix (settings/checks.py)
            check(self)
        registry.check(self)  # last: the chosen transport's own settings (disk_delta's writer, auto's profile)

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
    def from_dict(cls, values: dict[str, Any], where: str = "weight_sync") -> "WeightSyncConfig":
        """Return a config from a `weight_sync:` mapping (sections such as `p2p:` included; the flat spellings
        of the previous release are accepted with a deprecation line); unknown keys raise ValueError listing
        the valid ones, and a section written for a transport this job does not use is refused by name."""
        flat = sectioned(values, where)
        valid = field_names()
        unknown = sorted(set(flat) - set(valid))
        if unknown:
            raise ValueError(f"unknown {where} keys {unknown}; valid keys are {list(valid)} "
                             f"(and the sections p2p:, disk_delta:, sglang:, fleet:)")
        config = cls(**flat)
        problem = inert_section_problem(config, tuple(present_sections(values)))
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        return config

    @classmethod
    def from_yaml(cls, path: str, defaults: Optional[dict[str, Any]] = None) -> "WeightSyncConfig":
        """Return the config in the `weight_sync:` section of the training YAML at `path`. `defaults` (an
        application's own) apply where the section does not set a key; nothing else is filled in (a section
        without `family` leaves it None, and the trainer refuses to start saying where to set it)."""
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
    """Return the `--weight-sync-*` values given on the command line, by field name. Needs a parser whose
    weight-sync defaults are None (`add_weight_sync_args(parser, defaults=False)`): flags override a YAML
    section only where given."""
    return {name: getattr(namespace, f"weight_sync_{name}") for name in field_names()
            if getattr(namespace, f"weight_sync_{name}") is not None}


def field_names() -> tuple[str, ...]:
    """Return the names of WeightSyncConfig's fields in declaration order."""
    return tuple(f.name for f in dataclasses.fields(WeightSyncConfig))


def add_weight_sync_args(parser: argparse.ArgumentParser, *, defaults: bool = True) -> argparse.ArgumentParser:
    """Add `--weight-sync-*` flags to `parser` and return it (Megatron's extra_args_provider).

    A section's settings carry its name (`--weight-sync-p2p-backend`, `--weight-sync-disk-delta-dir`,
    `--weight-sync-fleet-wave-size`); the flat flags of the previous release still work with a deprecation line.
    With `defaults=False` unset flags stay None, for jobs whose YAML supplies the rest.
    """
    group = parser.add_argument_group("weight sync")
    for field in dataclasses.fields(WeightSyncConfig):
        default = field.default if defaults else None
        kwargs: dict[str, Any] = {"dest": f"weight_sync_{field.name}", "default": default}
        if field.type in ("bool", bool):
            kwargs["action"] = _DeprecatedBool
        elif field.type in ("int", int, "Optional[int]", "int | str"):
            kwargs.update(type=checks.int_or_word if field.type == "int | str" else int, action=_DeprecatedStore)
        elif field.type in ("float", float):
            kwargs.update(type=float, action=_DeprecatedStore)
        elif str(field.type).startswith("tuple"):
            kwargs.update(type=str, nargs="*", action=_DeprecatedStore)
        else:
            kwargs.update(type=str, action=_DeprecatedStore)
        old = deprecated_flag(field.name)
        group.add_argument(flag(field.name), *([old] if old else []), **kwargs)
    return parser


def _warn_if_deprecated(action: argparse.Action, option_string: Optional[str]) -> None:
    if option_string is not None and option_string != action.option_strings[0] and \
            not option_string.startswith(action.option_strings[0].replace("--", "--no-", 1)):
        warnings.warn(f"{option_string} is deprecated and will be removed in the next release; use "
                      f"{action.option_strings[0]}", DeprecationWarning, stacklevel=2)


class _DeprecatedStore(argparse._StoreAction):
    """A flag whose second spelling is the previous release's (warned about when used)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        _warn_if_deprecated(self, option_string)
        super().__call__(parser, namespace, values, option_string)


class _DeprecatedBool(argparse.BooleanOptionalAction):
    """A --flag/--no-flag pair whose second spellings are the previous release's (warned about when used)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        _warn_if_deprecated(self, option_string)
        super().__call__(parser, namespace, values, option_string)
