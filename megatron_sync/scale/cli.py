"""What `python -m megatron_sync.scale predict | auto` read: layouts as flags or a job YAML, into a planner.

    --trainer tp=8,pp=8,cp=4,ep=32          Megatron's grid (tp, pp, vpp, cp, dp, ep, etp)
    --fleet engines=8,tp=32,ep              engines of TP=32 with expert parallelism
    --fleet engines=4,dp=8,tp=1,ep          vLLM DP x EP: 8 attention groups of TP=1, experts over 8 ranks
    --fleet engines=1,tp=8,colocated        on the trainer's GPUs (colocated), or whole_vocab (reference engine)

A job YAML (`--config train.yaml`) gives the same: `trainer:` (tp, pp, cp, dp, ep, etp, vpp),
`weight_sync:` (hardware_profile, num_inference_ranks, engine_tp_size, engines, draft, checksum, p2p_*,
hf_config_path + family) and an optional top-level `colocated: true`; flags given on the command line win.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from megatron_sync.scale.hardware import profile_named, profile_names
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import MODELS, model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import SyncOptions
from megatron_sync.settings.checks import int_or_word

FLEET_FLAGS = {"ep": ("expert_parallel", True), "whole_vocab": ("vocab_parallel", False),
               "colocated": ("colocated", True)}
TRAINER_AXES = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "first_layers", "last_layers")


def layout_from_text(text: str, cls, flags: dict[str, tuple[str, bool]]):
    """Parse "tp=8,pp=2,ep" into a layout (a bare word is a flag: ep -> expert_parallel=True)."""
    values: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if not value:
            if key not in flags:
                raise SystemExit(f"{part!r}: expected key=value (flags: {sorted(flags)})")
            field, setting = flags[key]
            values[field] = setting
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise SystemExit(f"{part!r}: {key} must be an integer") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{text!r}: {e}") from None


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """Add the arguments `predict` and `auto` share."""
    p.add_argument("--config", default=None, help="a job YAML (trainer:, weight_sync:, colocated:); flags win")
    p.add_argument("--model", default=None, help=f"one of {sorted(MODELS)} or a config.json path (default kimi-k2)")
    p.add_argument("--family", default=None, help="the family of a config.json path")
    p.add_argument("--profile", default=None, help=f"one of {profile_names()} (default h100)")
    p.add_argument("--trainer", default=None,
                   help="trainer layout: tp,pp,vpp,cp,dp,ep,etp,first_layers,last_layers "
                        "(default tp=8,pp=8,cp=4,ep=32)")
    p.add_argument("--fleet", default=None,
                   help="engines: engines,tp[,dp][,ep][,whole_vocab][,colocated] (default engines=8,tp=32,ep)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket (P2P: piece) size in MiB (default 256)")
    p.add_argument("--fp8-block", type=int, default=0, help="FP8 block size to use instead of the config's")
    p.add_argument("--bf16", action="store_true", help="drop the config's quantization_config")
    p.add_argument("--no-mtp", action="store_true", help="engines serve no draft: leave the MTP layers out")
    p.add_argument("--no-checksum", action="store_true", help="weight_sync.checksum none")
    p.add_argument("--p2p-backend", default=None, choices=("nixl", "mooncake", "torch"))
    p.add_argument("--p2p-window-mb", type=float, default=None, help="P2P receive window (0: the staging set)")
    p.add_argument("--p2p-arena-mb", type=float, default=None, help="P2P sender arena (0: the whole share)")
    p.add_argument("--no-forward", action="store_true", help="p2p_forward false: the trainer writes every engine")
    p.add_argument("--staging-sets", type=int_or_word, default=None, choices=("auto", 1, 2),
                   help="staging sets per inference rank (weight_sync.staging_sets; default auto: 1 for engines "
                        "that copy, 2 for engines that run on a set)")


def _from_yaml(path: str) -> dict[str, Any]:
    """Return the settings a job YAML gives, under the names of the flags."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    ws, tr = doc.get("weight_sync") or {}, doc.get("trainer") or {}
    out: dict[str, Any] = {"trainer": ",".join(f"{a}={tr[a]}" for a in TRAINER_AXES if tr.get(a))}
    ranks, tp = ws.get("num_inference_ranks"), ws.get("engine_tp_size", 1)
    if ranks:
        parts = [f"engines={ranks // tp}", f"tp={tp}"] + (["colocated"] if doc.get("colocated") else [])
        out["fleet"] = ",".join(parts + ([] if ws.get("engines") else ["whole_vocab"]))
    if ws.get("hf_config_path"):
        out["model"], out["family"] = ws["hf_config_path"], ws.get("family")
    out.update({k: v for k, v in (("profile", ws.get("hardware_profile")), ("bucket_mb", ws.get("bucket_size_mb")),
                                  ("p2p_backend", ws.get("p2p_backend")), ("p2p_window_mb", ws.get("p2p_window_mb")),
                                  ("p2p_arena_mb", ws.get("p2p_arena_mb")),
                                  ("staging_sets", ws.get("staging_sets"))) if v is not None})
    out["no_mtp"] = ws.get("draft") == "skip"
    out["no_checksum"] = ws.get("checksum") == "none"
    out["no_forward"] = ws.get("p2p_forward") is False
    out["sglang"] = any(str(e).startswith("sglang=") for e in ws.get("engines") or ())
    return out


DEFAULTS = {"model": "kimi-k2", "profile": "h100", "trainer": "tp=8,pp=8,cp=4,ep=32", "fleet": "engines=8,tp=32,ep",
            "bucket_mb": 256.0, "p2p_backend": "nixl", "p2p_window_mb": 0.0, "p2p_arena_mb": 0.0,
            "staging_sets": "auto"}


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Return `args` with the job YAML's settings under any flag not given, then the defaults."""
    out = copy.copy(args)
    found = _from_yaml(args.config) if args.config else {}
    for key, value in found.items():
        if getattr(out, key, None) in (None, False, 0):
            setattr(out, key, value)
    for key, value in DEFAULTS.items():
        if getattr(out, key, None) is None:
            setattr(out, key, value)
    out.sglang = found.get("sglang", False)
    return out


def planner_of(args: argparse.Namespace) -> ScalePlanner:
    """Return the planner of resolved `args` (`resolve_args`)."""
    family, config = model_named(args.model, args.family)
    config = copy.deepcopy(config)
    if args.fp8_block and config.get("quantization_config"):
        config["quantization_config"]["weight_block_size"] = [args.fp8_block, args.fp8_block]
    if args.bf16:
        config.pop("quantization_config", None)
    gpus = int(profile_named(args.profile).gpus_per_node.value)
    trainer = layout_from_text(args.trainer + f",gpus_per_node={gpus}", TrainerLayout, {})
    fleet = layout_from_text(args.fleet + f",gpus_per_node={gpus}", FleetLayout, FLEET_FLAGS)
    try:
        return ScalePlanner(family, config, trainer, fleet, draft=not args.no_mtp)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def options_of(args: argparse.Namespace) -> SyncOptions:
    """Return the sync settings of resolved `args`."""
    return SyncOptions(checksum=not args.no_checksum, p2p_backend=args.p2p_backend, staging_sets=args.staging_sets)


def p2p_of(args: argparse.Namespace) -> dict:
    """Return the P2P schedule's settings of resolved `args` (bytes)."""
    return {"window_bytes": int(args.p2p_window_mb * 2**20), "arena_bytes": int(args.p2p_arena_mb * 2**20),
            "forward": not args.no_forward}


def dumps(value: Any) -> str:
    """Return `value` as one JSON line (for --json)."""
    return json.dumps(value, sort_keys=True, default=str)
