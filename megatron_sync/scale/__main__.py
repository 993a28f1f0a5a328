"""python -m megatron_sync.scale: predict a sync at scale, sweep sizes and node counts, check published rows.

    python -m megatron_sync.scale predict --model kimi-k2 --profile h100 \\
        --trainer tp=8,pp=8,cp=4,ep=32 --fleet engines=8,tp=32,ep --fp8-block 64
    python -m megatron_sync.scale sweep --profile h100 --plot bench/scale.png
    python -m megatron_sync.scale published
    python -m megatron_sync.scale profile h100

`make scale` runs all four (the evidence case of issue 16, the sweep with its plot, the published rows).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

from megatron_sync.core.metrics import align
from megatron_sync.scale.hardware import profile_named, profile_names
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import MODELS, model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.published import ROWS, compare
from megatron_sync.scale.timing import SyncOptions, models, predict

GB = 1e9
TRANSPORTS = ("broadcast", "p2p", "disk_delta", "ipc")


def _layout(text: str, cls, flags: dict[str, tuple[str, bool]]):
    """Parse "tp=8,pp=2,ep" into a layout (a bare word is a flag: ep -> expert_parallel=True)."""
    values = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if not value:
            if key not in flags:
                raise SystemExit(f"{part!r}: expected key=value (flags: {sorted(flags)})")
            field, setting = flags[key]
            values[field] = setting
        else:
            values[key] = int(value)
    try:
        return cls(**values)
    except TypeError as e:
        raise SystemExit(f"{text!r}: {e}") from None


def _planner(args) -> ScalePlanner:
    family, config = model_named(args.model, args.family)
    config = copy.deepcopy(config)
    if args.fp8_block and config.get("quantization_config"):
        config["quantization_config"]["weight_block_size"] = [args.fp8_block, args.fp8_block]
    if args.bf16:
        config.pop("quantization_config", None)
    profile = profile_named(args.profile)
    gpus = int(profile.gpus_per_node.value)
    trainer = _layout(args.trainer + f",gpus_per_node={gpus}", TrainerLayout, {})
    fleet = _layout(args.fleet + f",gpus_per_node={gpus}", FleetLayout,
                    {"ep": ("expert_parallel", True), "whole_vocab": ("vocab_parallel", False)})
    return ScalePlanner(family, config, trainer, fleet)


def cmd_predict(args) -> None:
    started = time.perf_counter()
    planner = _planner(args)
    profile = profile_named(args.profile)
    print(f"model {args.model}: {len(planner.specs):,} HF tensors, {planner.model_bytes / GB:,.1f} GB "
          f"({', '.join(sorted({str(s.dtype).removeprefix('torch.') for s in planner.specs}))}); "
          f"trainer {planner.trainer.describe()}; engines {planner.fleet.describe()}; profile {profile.name} "
          f"({profile.description}); planner setup {planner.setup_seconds:.1f} s")
    rows, details = [], []
    for transport in TRANSPORTS:
        if not models(transport, profile) or (transport == "ipc" and planner.fleet.ranks != planner.trainer.world):
            continue
        summary = planner.plan(transport, bucket_bytes=int(args.bucket_mb * 2**20), measure_memory=args.plan_memory)
        p = predict(summary, profile, SyncOptions(checksum=not args.no_checksum))
        send = max(summary.senders, key=lambda e: e.bytes)
        recv = max(summary.receivers, key=lambda e: e.bytes)
        memory = f"{summary.peak_bytes / 2**20:,.0f}" if summary.peak_bytes is not None else "-"
        rows.append([transport + (" (design)" if transport == "ipc" else ""), f"{p.seconds:.2f}",
                     f"{p.physical_bound:.2f}", p.bound, f"{len(summary.senders)}", f"{send.bytes / GB:.1f}",
                     f"{send.messages:,}", f"{recv.bytes / GB:.1f}", f"{recv.tensors:,}", f"{recv.messages:,}",
                     f"{max(s.largest for s in summary.senders) / 2**20:,.0f}", f"{summary.seconds:.1f}", memory])
        details.append((transport, p))
    print(align(["transport", "predicted s", "bound s", "bounded by", "senders", "max send GB", "its msgs",
                 "max recv GB", "its tensors", "its msgs", "largest MiB", "plan s", "plan MiB"], rows))
    print("\nbound s = the largest shard an inference rank needs / its NIC (no transport can beat it)")
    if args.phases:
        for transport, p in details:
            print(f"\n{transport}: " + "; ".join(f"{ph.name} {ph.seconds:.2f}s ({ph.where})" for ph in p.phases
                                                 if ph.seconds >= 0.01))
    print(f"\n{time.perf_counter() - started:.0f} s in all")


# (model, trainer, engines) per point of the sweep: the node count grows with the model.
SWEEP = (
    ("qwen3-30b-a3b", "tp=4,dp=4,ep=8", "engines={e},tp=8,ep"),
    ("glm-4.5-air", "pp=4,dp=8,ep=8", "engines={e},tp=8,ep"),
    ("qwen3-235b-a22b", "tp=4,pp=4,cp=2,dp=2,ep=16", "engines={e},tp=16,ep"),
    ("deepseek-v3", "tp=8,pp=8,cp=2,ep=16", "engines={e},tp=32,ep"),
    ("kimi-k2", "tp=8,pp=8,cp=4,ep=32", "engines={e},tp=32,ep"),
)


def cmd_sweep(args) -> None:
    """Predicted time per transport against model size, and against the number of inference engines."""
    profile = profile_named(args.profile)
    by_size, by_nodes = [], []
    for model, trainer, fleet in SWEEP:
        engines = args.engines
        ns = argparse.Namespace(model=model, family=None, fp8_block=64, bf16=False, profile=args.profile,
                                trainer=trainer, fleet=fleet.format(e=engines))
        planner = _planner(ns)
        point = _point(planner, profile, args.bucket_mb)
        by_size.append((model, planner.model_bytes, planner.trainer.nodes, planner.fleet.nodes, point))
        print(f"{model}: {planner.model_bytes / GB:,.0f} GB; " + ", ".join(f"{t} {s:.2f}s" for t, s in point.items()),
              flush=True)
    model, trainer, fleet = SWEEP[-1]
    for engines in args.engine_counts:
        ns = argparse.Namespace(model=model, family=None, fp8_block=64, bf16=False, profile=args.profile,
                                trainer=trainer, fleet=fleet.format(e=engines))
        planner = _planner(ns)
        point = _point(planner, profile, args.bucket_mb)
        by_nodes.append((engines, planner.fleet.nodes, point))
        print(f"{model} into {planner.fleet.nodes} inference nodes: " + ", ".join(f"{t} {s:.2f}s"
                                                                             for t, s in point.items()), flush=True)
    if args.plot:
        _plot(args.plot, profile.name, by_size, by_nodes, SWEEP[-1][0])
        print(f"plot: {args.plot}")


def _point(planner: ScalePlanner, profile, bucket_mb: float) -> dict[str, float]:
    out = {}
    for transport in ("broadcast", "p2p", "disk_delta"):
        p = predict(planner.plan(transport, bucket_bytes=int(bucket_mb * 2**20)), profile)
        out[transport] = p.seconds
        out["bound"] = p.physical_bound
    return out


def _plot(path: str, profile: str, by_size, by_nodes, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"broadcast": "o-", "p2p": "s-", "disk_delta": "^-", "bound": "k--"}
    for key, style in styles.items():
        left.plot([b / GB for _, b, _, _, _ in by_size], [p[key] for *_, p in by_size], style,
                  label="physical bound (bytes per receiver / its NIC)" if key == "bound" else key)
        right.plot([n for _, n, _ in by_nodes], [p[key] for *_, p in by_nodes], style,
                   label="physical bound" if key == "bound" else key)
    for name, nbytes, tn, inn, _ in by_size:
        left.annotate(f"{name}\n{tn}+{inn} nodes", (nbytes / GB, by_size[0][4]["bound"]), fontsize=7,
                      rotation=90, va="bottom")
    for ax in (left, right):
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("predicted sync seconds")
        ax.legend(fontsize=8)
    left.set_xlabel("model bytes as the engine holds them (GB)")
    left.set_title(f"by model size ({profile} nodes)")
    right.set_xlabel(f"inference nodes receiving {model}")
    right.set_title(f"{model}: by the number of inference nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_published(args) -> None:
    rows = []
    for row in ROWS:
        c = compare(row)
        rows.append([row.system, row.model, row.trainer.describe(), row.fleet.describe(), row.profile,
                     f"{row.seconds:.2f}", row.variant, f"{c['predicted']:.2f}", f"{100 * c['error']:+.0f}%",
                     "yes" if row.faithful else "no", f"{c['ours']['ours-broadcast']:.2f}",
                     f"{c['ours']['ours-p2p']:.2f}", c["bound"]])
        print(f"{row.system} / {row.model}: measured {row.seconds:.2f} s, predicted {c['predicted']:.2f} s",
              file=sys.stderr, flush=True)
    print(align(["system", "model", "trainer", "engines", "profile", "measured s", "variant", "predicted s",
                 "error", "faithful", "ours bcast s", "ours p2p s", "bounded by"], rows))


def cmd_profile(args) -> None:
    profile = profile_named(args.name)
    print(f"{profile.name}: {profile.description}")
    print(align(["field", "value", "source"], [list(r) for r in profile.table()]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_sync.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="plan and predict one sync per transport")
    p.add_argument("--model", default="kimi-k2", help=f"one of {sorted(MODELS)} or a config.json path")
    p.add_argument("--family", default=None, help="the family of a config.json path")
    p.add_argument("--profile", default="h100", help=f"one of {profile_names()}")
    p.add_argument("--trainer", default="tp=8,pp=8,cp=4,ep=32", help="trainer layout: tp,pp,vpp,cp,dp,ep,etp")
    p.add_argument("--fleet", default="engines=8,tp=32,ep", help="engines: engines,tp[,ep][,whole_vocab]")
    p.add_argument("--bucket-mb", type=float, default=1024.0)
    p.add_argument("--fp8-block", type=int, default=0, help="FP8 block size to use instead of the config's")
    p.add_argument("--bf16", action="store_true", help="drop the config's quantization_config")
    p.add_argument("--no-checksum", action="store_true", help="weight_sync.checksum none")
    p.add_argument("--plan-memory", action="store_true", help="also measure the planners' peak memory (slower)")
    p.add_argument("--phases", action="store_true", help="print every phase of every prediction")
    p.set_defaults(fn=cmd_predict)
    s = sub.add_parser("sweep", help="predicted time against model size and node count, with a plot")
    s.add_argument("--profile", default="h100")
    s.add_argument("--bucket-mb", type=float, default=1024.0)
    s.add_argument("--engines", type=int, default=8, help="engines per model in the size sweep")
    s.add_argument("--engine-counts", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    s.add_argument("--plot", default=None, help="write the plot here (PNG)")
    s.set_defaults(fn=cmd_sweep)
    sub.add_parser("published", help="published syncs of other systems against the model").set_defaults(
        fn=cmd_published)
    pr = sub.add_parser("profile", help="a hardware profile's numbers and their sources")
    pr.add_argument("name")
    pr.set_defaults(fn=cmd_profile)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
