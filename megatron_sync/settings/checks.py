"""The checks every `WeightSyncConfig` passes on creation, by theme; each raises ValueError naming the field and
the fix. `ALL` runs them in order; the chosen transport's own check runs after them (`settings.registry`)."""

from __future__ import annotations

from typing import Any, Callable

from megatron_sync.core.meta import dtype_from_name
from megatron_sync.layout.staging import check_staging_sets
from megatron_sync.settings import registry
from megatron_sync.settings.choices import (BACKENDS, CHECKSUM_CHOICES, DRAFT_CHOICES, DRIFT_ACTIONS, INFLIGHT_POLICIES,
                                            P2P_BACKENDS, P2P_PROTOCOLS, RUN_ID, SGLANG_LOADS, parse_engine)
from megatron_sync.settings.sections import inert_section_problem

Config = Any  # a WeightSyncConfig (this module is below it)


def check_bool(name: str, value: Any) -> None:
    """Raise unless `value` is true or false."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int) -> None:
    """Raise unless `value` is an integer >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_number(name: str, value: Any, *, positive: bool, what: str = "a number", note: str = "") -> None:
    """Raise unless `value` is a number > 0 (`positive`) or >= 0; `note` says what 0 means."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be {what} {'> 0' if positive else '>= 0'}{note}, got {value!r}")


def int_or_word(text: str) -> int | str:
    """Return a flag's value as an int when it is a number ("1"), else as it is ("auto")."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; use one of {list(choices)}")


def _job(c: Config) -> None:
    check_bool("enabled", c.enabled)
    check_int("every_n_steps", c.every_n_steps, minimum=1)
    check_choice("transport", c.transport, tuple(registry.names()))
    check_choice("backend", c.backend, BACKENDS)
    if c.hardware_profile is not None and c.transport != "auto":
        raise ValueError(f"hardware_profile={c.hardware_profile!r} is read by transport 'auto' only (the scale model "
                         f"chooses with it); this job uses transport {c.transport!r}: drop it, or set transport: auto")
    if not isinstance(c.master_address, str) or not c.master_address:
        raise ValueError("master_address must be a non-empty host name or IP, e.g. '10.0.0.1'")
    check_int("master_port", c.master_port, minimum=1)
    if c.master_port > 65535:
        raise ValueError(f"master_port={c.master_port} is not a TCP port; use 1..65535")
    if c.run_id is not None and (not isinstance(c.run_id, str) or not RUN_ID.fullmatch(c.run_id)):
        raise ValueError(f"run_id={c.run_id!r} is not valid: use 1-64 letters, digits, '.', '_' or '-' "
                         "(or null to let the trainer name the session)")
    check_bool("sync_on_start", c.sync_on_start)
    if c.metrics_path is not None and not isinstance(c.metrics_path, str):
        raise ValueError("metrics_path must be a file path string or null")
    check_int("metrics_port", c.metrics_port, minimum=0)


def _sizes(c: Config) -> None:
    check_int("num_inference_ranks", c.num_inference_ranks, minimum=1)
    check_int("engine_tp_size", c.engine_tp_size, minimum=1)
    if c.num_inference_ranks % c.engine_tp_size:
        raise ValueError(f"engine_tp_size={c.engine_tp_size} must divide num_inference_ranks={c.num_inference_ranks}"
                         " (each engine spans engine_tp_size ranks)")
    check_number("bucket_size_mb", c.bucket_size_mb, positive=True)
    check_number("gather_budget_mb", c.gather_budget_mb, positive=True)
    check_number("timeout_s", c.timeout_s, positive=True)
    check_staging_sets(c.staging_sets)


def _model(c: Config) -> None:
    if c.family is not None and (not isinstance(c.family, str) or not c.family):
        raise ValueError("family must name a model family, e.g. 'qwen3' or 'deepseek_v3'")
    if c.hf_config_path is not None and not isinstance(c.hf_config_path, str):
        raise ValueError("hf_config_path must be a path string or null")
    try:
        dtype_from_name(c.dtype)
    except ValueError as e:
        raise ValueError(f"dtype: {e}") from None
    check_choice("inflight_policy", c.inflight_policy, INFLIGHT_POLICIES)
    check_choice("draft", c.draft, DRAFT_CHOICES)
    check_choice("checksum", c.checksum, CHECKSUM_CHOICES)


def _engines(c: Config) -> None:
    if isinstance(c.engines, str) or not isinstance(c.engines, (list, tuple)):
        raise ValueError(f"engines must be a list of KIND=URL entries, got {c.engines!r}")
    object.__setattr__(c, "engines", tuple(c.engines))  # YAML and flags give lists
    check_choice("sglang_load", c.sglang_load, SGLANG_LOADS)
    sglang = [e for e in c.engines if parse_engine(e)[0] == "sglang"]
    if sglang and c.transport in ("p2p", "ipc"):
        raise ValueError(f"transport {c.transport!r} writes into megatron-sync receivers' memory, which SGLang's "
                         f"update API does not expose (engines {sglang}); use transport 'sglang' for SGLang, or "
                         f"{c.transport!r} with megatron-sync inference ranks and vLLM servers")


def _fleet(c: Config) -> None:
    check_bool("fleet", c.fleet)
    check_bool("relay", c.relay)
    check_int("min_engines", c.min_engines, minimum=1)
    check_int("wave_size", c.wave_size, minimum=0)
    check_int("max_staleness", c.max_staleness, minimum=0)
    if c.max_staleness > 1:
        raise ValueError(f"max_staleness={c.max_staleness} is not supported; use 0 (every wave before sync() "
                         "returns) or 1 (later waves while training goes on)")
    if c.engine_id is not None:
        check_int("engine_id", c.engine_id, minimum=0)
    if not c.fleet:
        return
    if c.transport not in ("broadcast", "p2p", "sglang"):
        raise ValueError(f"fleet: true runs over transport 'broadcast' or 'p2p' (one link per engine, rebuilt as "
                         f"engines come and go) or 'sglang' (the servers of weight_sync.engines); transport "
                         f"{c.transport!r} is not elastic yet")
    if c.transport == "sglang" and (c.relay or c.wave_size or c.max_staleness):
        raise ValueError("a fleet of SGLang servers is fed by the trainer in one wave (SGLang's ranks relay to no "
                         "one): drop fleet.relay, fleet.wave_size and fleet.max_staleness")
    if c.transport == "p2p" and (c.relay or c.max_staleness):
        raise ValueError("a fleet over p2p chains the engines of one layout within each wave (p2p.forward) instead "
                         "of relaying after commits, and runs every wave before sync() returns: drop fleet.relay "
                         "and fleet.max_staleness")
    if c.min_engines > c.num_engines and not c.engines:
        raise ValueError(f"min_engines={c.min_engines} is more than the initial fleet of {c.num_engines} engine(s) "
                         "(num_inference_ranks / engine_tp_size); lower min_engines")


def _delta(c: Config) -> None:
    for name in ("delta_snapshot_every", "delta_retention", "delta_queue_depth", "delta_encode_threads"):
        check_int(name, getattr(c, name), minimum=1)
    if c.transport == "disk_delta":
        for name in ("delta_dir", "delta_local_dir"):
            if not isinstance(getattr(c, name), str) or not getattr(c, name):
                raise ValueError(f"transport='disk_delta' needs {name}: " + (
                    "the shared directory both jobs mount, e.g. /shared/run42/weights" if name == "delta_dir"
                    else "a directory on each inference host's local disk, e.g. /local/megatron_sync"))


def _p2p(c: Config) -> None:
    check_choice("p2p_backend", c.p2p_backend, P2P_BACKENDS)
    check_choice("p2p_protocol", c.p2p_protocol, P2P_PROTOCOLS)
    for name in ("p2p_arena_mb", "p2p_window_mb"):
        check_number(name, getattr(c, name), positive=False, what="a number of MiB", note=" (0: unbounded)")
    check_number("p2p_nixl_wake_ms", c.p2p_nixl_wake_ms, positive=False, what="a number of milliseconds",
                 note=" (0: NIXL's progress thread polls without pause)")
    check_bool("p2p_forward", c.p2p_forward)
    if not isinstance(c.p2p_device_name, str):
        raise ValueError("p2p_device_name must be a string of RDMA device names, e.g. 'mlx5_0,mlx5_1' (or '')")
    if c.p2p_local_hostname is not None and (not isinstance(c.p2p_local_hostname, str) or not c.p2p_local_hostname):
        raise ValueError("p2p_local_hostname must be a host name or IP this rank is reachable at, or null")


def _proof(c: Config) -> None:
    check_int("verify_every", c.verify_every, minimum=0)
    check_int("canary_length", c.canary_length, minimum=0)
    check_int("canary_seed", c.canary_seed, minimum=0)
    if c.canary_length == 1:
        raise ValueError("canary_length=1 scores nothing (every token is scored given those before it); use >= 2, "
                         "or 0 for no canary")
    try:  # flags give strings
        object.__setattr__(c, "canary_tokens", tuple(int(t) for t in c.canary_tokens))
    except (TypeError, ValueError):
        raise ValueError(f"canary_tokens must be token ids (integers), got {c.canary_tokens!r}") from None
    check_number("max_logprob_drift", c.max_logprob_drift, positive=False, note=" (0: record only)")
    check_choice("on_drift", c.on_drift, DRIFT_ACTIONS)


def _sections(c: Config) -> None:
    problem = inert_section_problem(c)
    if problem is not None:
        raise ValueError(problem)


ALL: tuple[Callable[[Config], None], ...] = (_job, _sizes, _model, _engines, _fleet, _delta, _p2p, _proof, _sections)
"""Every check, in the order a config is read."""
