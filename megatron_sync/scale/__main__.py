"""python -m megatron_sync.scale: predict a sync at scale, ask what `transport: auto` would choose, sweep sizes
and node counts, check published syncs.

    python -m megatron_sync.scale predict --model kimi-k2 --profile h100 \\
        --trainer tp=8,pp=8,cp=4,ep=32 --fleet engines=8,tp=32,ep --fp8-block 64 --phases
    python -m megatron_sync.scale auto --model qwen3-30b-a3b --trainer tp=4,dp=2,ep=8 --fleet engines=1,tp=8,colocated
    python -m megatron_sync.scale auto --config train.yaml          # a job's own settings
    python -m megatron_sync.scale sweep --profile h100 --plot bench/scale.png
    python -m megatron_sync.scale published [--record]
    python -m megatron_sync.scale profile h100

Layout flags: `megatron_sync.scale.cli`. `make scale` runs predict, sweep and published.
"""

from __future__ import annotations

import argparse
import time

from megatron_sync.core.metrics import align
from megatron_sync.scale import cli
from megatron_sync.scale.auto import BUCKET_CHOICES_MB, choose, exclusions
from megatron_sync.scale.hardware import profile_named
from megatron_sync.scale.plans import ipc_refusal
from megatron_sync.scale.published import print_published, record_predictions
from megatron_sync.scale.sweep import add_sweep_args
from megatron_sync.scale.timing import models, predict

GB = 1e9
TRANSPORTS = ("broadcast", "p2p", "disk_delta", "ipc")


def _header(planner, profile) -> str:
    draft = planner.draft_bytes()
    return (f"model: {len(planner.specs):,} HF tensors, {planner.model_bytes / GB:,.1f} GB "
            f"({', '.join(sorted({str(s.dtype).removeprefix('torch.') for s in planner.specs}))})"
            + (f", draft (MTP) layers {draft / GB:.1f} GB included" if draft else "")
            + f"\ntrainer {planner.trainer.describe()}\nengines {planner.fleet.describe(planner.trainer)}"
            + f"\nprofile {profile.name} ({profile.description}); planner setup {planner.setup_seconds:.1f} s")


def _row(transport: str, summary, p) -> list[str]:
    send = max(summary.senders, key=lambda e: e.bytes)
    recv = max(summary.receivers, key=lambda e: e.bytes)
    return [transport, f"{p.seconds:.2f}", f"{p.physical_bound:.2f}", f"{p.seconds / p.physical_bound:.1f}x",
            p.bound, f"{len(summary.senders)}", f"{send.bytes / GB:.1f}", f"{recv.bytes / GB:.1f}",
            f"{recv.tensors:,}", f"{summary.seconds:.1f}"]


def cmd_predict(args) -> None:
    started = time.perf_counter()
    args = cli.resolve_args(args)
    planner, profile, options = cli.planner_of(args), profile_named(args.profile), cli.options_of(args)
    print(_header(planner, profile))
    rows, details, left_out = [], [], []
    for transport in TRANSPORTS:
        why = ipc_refusal(planner.trainer, planner.fleet) if transport == "ipc" else ""
        if why or not models(transport, profile, planner.trainer.tp, options):
            left_out.append(f"{transport}: {why or f'profile {profile.name!r} has no model of it'}")
            continue
        extra = cli.p2p_of(args) if transport == "p2p" else {}
        summary = planner.plan(transport, bucket_bytes=int(args.bucket_mb * 2**20), **extra)
        p = predict(summary, profile, options)
        rows.append(_row(transport, summary, p))
        details.append((transport, summary, p))
    print(align(["transport", "predicted s", "bound s", "x bound", "bounded by", "senders", "max send GB",
                 "max recv GB", "its tensors", "plan s"], rows))
    print("\nbound s = what no transport can beat: a rank's shard over every link that feeds it (NIC, NVLink, its own "
          "GPU when colocated), and a node's distinct bytes over its NICs (megatron_sync.scale.timing.physical_bound)")
    for line in left_out:
        print(f"not predicted: {line}")
    for transport, summary, p in details:
        if transport == "p2p":
            x = summary.extra
            print(f"p2p schedule: busiest sender / mean {x['busiest_over_mean']:.3f}; trainer egress / model bytes "
                  f"{x['egress'] / planner.model_bytes:.3f}; {x['p2p'].heads} head engine(s), chains of "
                  f"{x['p2p'].chain}; {x['p2p'].items:,} items balanced")
    for transport, _, p in details:
        for note in p.notes:
            print(f"{transport}: {note}")
    if args.phases:
        for transport, _, p in details:
            print(f"\n{transport}:")
            print(align(["phase", "s", "where", "rate (source)"],
                        [[ph.name, f"{ph.seconds:.3f}", ph.where, ph.rate or "-"] for ph in p.phases]))
    print(f"\n{time.perf_counter() - started:.0f} s in all")


def cmd_auto(args) -> None:
    args = cli.resolve_args(args)
    planner, profile, options = cli.planner_of(args), profile_named(args.profile), cli.options_of(args)
    print(_header(planner, profile))
    buckets = [args.bucket_mb] if args.fixed_bucket else BUCKET_CHOICES_MB
    excluded = exclusions(sglang_engines=args.sglang, trainer=planner.trainer, fleet=planner.fleet)
    choice = choose(planner, profile, excluded=excluded, bucket_choices_mb=buckets, options=options,
                    p2p=cli.p2p_of(args))
    rows = [[c.transport, f"{c.bucket_size_mb:g}" if c.seconds is not None else "-",
             f"{c.seconds:.3f}" if c.seconds is not None else "-",
             c.bound if c.seconds is not None else f"not a candidate: {c.bound}"] for c in choice.candidates]
    print(align(["candidate", "bucket MiB", "predicted s", "bounded by"], rows))
    print(f"\nchoice: transport {choice.transport}, bucket {choice.bucket_size_mb:g} MiB\nreason: {choice.reason}")


def cmd_published(args) -> None:
    if args.record:
        path = record_predictions()
        print(f"recorded the model's predictions of every check row in {path}")
        return
    print_published()


def cmd_profile(args) -> None:
    profile = profile_named(args.name)
    print(f"{profile.name}: {profile.description}")
    print(align(["field", "value", "source"], [list(r) for r in profile.table()]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_sync.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="plan and predict one sync per transport")
    cli.add_layout_args(p)
    p.add_argument("--phases", action="store_true", help="print every phase of every prediction, with its rate")
    p.set_defaults(fn=cmd_predict)
    a = sub.add_parser("auto", help="what transport: auto would choose, every candidate and why")
    cli.add_layout_args(a)
    a.add_argument("--fixed-bucket", action="store_true", help="only --bucket-mb instead of auto's bucket choices")
    a.set_defaults(fn=cmd_auto)
    add_sweep_args(sub)
    pub = sub.add_parser("published", help="published syncs of other systems against the model")
    pub.add_argument("--record", action="store_true", help="write the model's predictions of the check rows")
    pub.set_defaults(fn=cmd_published)
    pr = sub.add_parser("profile", help="a hardware profile's numbers and their sources")
    pr.add_argument("name")
    pr.set_defaults(fn=cmd_profile)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
