"""`python -m megatron_sync.scale sweep`: predicted sync time against model size and against the number of
inference nodes, per transport at the bucket size `transport: auto` would pick for it, with a plot."""

from __future__ import annotations

import argparse

from megatron_sync.scale import cli
from megatron_sync.scale.auto import BUCKET_CHOICES_MB
from megatron_sync.scale.hardware import profile_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.timing import predict

GB = 1e9
# (model, trainer, engines) per point of the sweep: the node count grows with the model.
SWEEP = (
    ("qwen3-30b-a3b", "tp=4,dp=4,ep=8", "engines={e},tp=8,ep"),
    ("glm-4.5-air", "pp=4,dp=8,ep=8", "engines={e},tp=8,ep"),
    ("qwen3-235b-a22b", "tp=4,pp=4,cp=2,dp=2,ep=16", "engines={e},tp=16,ep"),
    ("deepseek-v3", "tp=8,pp=8,cp=2,ep=16,first_layers=7,last_layers=6", "engines={e},tp=32,ep"),
    ("kimi-k2", "tp=8,pp=8,cp=4,ep=32", "engines={e},tp=32,ep"),
)
STYLES = {"broadcast": "o-", "p2p": "s-", "disk_delta": "^-", "bound": "k--"}


def add_sweep_args(sub) -> None:
    """Add the `sweep` command to the CLI's subparsers."""
    s = sub.add_parser("sweep", help="predicted time against model size and node count, with a plot")
    s.add_argument("--profile", default="h100")
    s.add_argument("--engines", type=int, default=8, help="engines per model in the size sweep")
    s.add_argument("--engine-counts", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    s.add_argument("--plot", default=None, help="write the plot here (PNG)")
    s.set_defaults(fn=cmd_sweep)


def planner_at(model: str, trainer: str, fleet: str, profile: str) -> ScalePlanner:
    """Return the planner of one sweep point (FP8 models with [64, 64] blocks, as Miles runs Kimi-K2)."""
    ns = argparse.Namespace(model=model, family=None, fp8_block=64, bf16=False, profile=profile, trainer=trainer,
                            fleet=fleet, no_mtp=False)
    return cli.planner_of(ns)


def point(planner: ScalePlanner, profile) -> dict[str, tuple[float, float]]:
    """Return per transport (its best predicted seconds over auto's bucket sizes, that bucket in MiB), and
    the physical bound."""
    out: dict[str, tuple[float, float]] = {}
    for transport in ("broadcast", "p2p", "disk_delta"):
        buckets = BUCKET_CHOICES_MB if transport != "disk_delta" else BUCKET_CHOICES_MB[-1:]
        best = None
        for mb in buckets:
            p = predict(planner.plan(transport, bucket_bytes=int(mb * 2**20)), profile)
            if best is None or p.seconds < best[0]:
                best = (p.seconds, mb)
            out["bound"] = (p.physical_bound, 0.0)
        out[transport] = best
    return out


def _line(label: str, p: dict) -> str:
    return label + ", ".join(f"{t} {s:.2f}s" + (f" @{mb:g}MiB" if mb else "") for t, (s, mb) in p.items())


def cmd_sweep(args) -> None:
    """Predicted time per transport against model size, and against the number of inference engines."""
    profile = profile_named(args.profile)
    by_size, by_nodes = [], []
    for model, trainer, fleet in SWEEP:
        planner = planner_at(model, trainer, fleet.format(e=args.engines), args.profile)
        p = point(planner, profile)
        by_size.append((model, planner.model_bytes, planner.trainer.nodes, planner.fleet.nodes(planner.trainer), p))
        print(_line(f"{model}: {planner.model_bytes / GB:,.0f} GB; ", p), flush=True)
    model, trainer, fleet = SWEEP[-1]
    for engines in args.engine_counts:
        planner = planner_at(model, trainer, fleet.format(e=engines), args.profile)
        p = point(planner, profile)
        nodes = planner.fleet.nodes(planner.trainer)
        by_nodes.append((engines, nodes, p))
        print(_line(f"{model} into {nodes} inference nodes: ", p), flush=True)
    p2p = [p["p2p"][0] for *_, p in by_nodes]
    print(f"p2p from {by_nodes[0][1]} to {by_nodes[-1][1]} inference nodes: {min(p2p):.2f}-{max(p2p):.2f} s "
          f"(largest / smallest {max(p2p) / min(p2p):.2f})")
    if args.plot:
        _plot(args.plot, profile.name, by_size, by_nodes, SWEEP[-1][0])
        print(f"plot: {args.plot}")


def _plot(path: str, profile: str, by_size, by_nodes, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for key, style in STYLES.items():
        label = "physical bound (shard / its input links)" if key == "bound" else key
        left.plot([b / GB for _, b, _, _, _ in by_size], [p[key][0] for *_, p in by_size], style, label=label)
        right.plot([n for _, n, _ in by_nodes], [p[key][0] for *_, p in by_nodes], style, label=label)
    for name, nbytes, tn, inn, _ in by_size:
        left.annotate(f"{name}\n{tn}+{inn} nodes", (nbytes / GB, by_size[0][4]["bound"][0]), fontsize=7,
                      rotation=90, va="bottom")
    for ax in (left, right):
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("predicted sync seconds (best bucket of transport: auto's choices)")
        ax.legend(fontsize=8)
    left.set_xlabel("model bytes as the engine holds them (GB)")
    left.set_title(f"by model size ({profile} nodes)")
    right.set_xlabel(f"inference nodes receiving {model}")
    right.set_title(f"{model}: by the number of inference nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
