"""A custom Megatron training loop with weight sync: the shape a user's own entry point takes.

    NPROC=1 launch/train.sh --module examples.custom_loop -- --config train.yaml --steps 3

With `--handoff` it is a colocated loop (trainer and engines taking turns on the same devices, e.g. one
job from launch/colocate.sh with `transport: ipc`): before each step the engines free their weights and
the trainer takes back its gradient buffers and optimizer state; after it, the trainer gives them up and
the engines take their memory back as the sync begins (megatron_sync.engines.handoff).

`train.yaml` holds the `weight_sync:` section (family, hf_config_path, rendezvous,
engine layout...). The only lines a real job adds to its loop are marked
"weight sync". Building the model is the user's own code; on this CPU-only
machine it is a tiny Megatron model from the test support (with its megatron-core
CPU shims), which a GPU job replaces with its real model provider.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import sys

import torch
import torch.distributed as dist

from megatron_sync.drivers.callback import WeightSyncCallback
from megatron_sync.settings.config import WeightSyncConfig, add_weight_sync_args, explicit_flags
from megatron_sync.engines.handoff import TrainerMemory
from megatron_sync.core.grid import ParallelLayout


def build_model(family: str, seed: int, rotary_base: float | None = None):
    """The user's model provider (here: a tiny CPU model, whose HF twin the engine serves; `rotary_base`
    as Megatron-LM's --rotary-base, default the tiny model's)."""
    from examples.tiny import models
    from examples.tiny.megatron import init_megatron
    from examples.tiny.train import make_optimizer, wrap_in_ddp

    init_megatron(seed=seed)
    spec = models.ModelSpec(family)
    if rotary_base is not None:
        spec = dataclasses.replace(spec, rope_theta=rotary_base)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=seed), spec)
    model = wrap_in_ddp(chunks)
    return model, make_optimizer(model, lr=1e-3), spec.vocab_size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="a custom Megatron training loop with weight sync")
    parser.add_argument("--config", required=True, help="YAML with a weight_sync: section")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rotary-base", type=float, default=None, help="the model's RoPE base (Megatron's own)")
    parser.add_argument("--handoff", action="store_true", help="colocated: hand memory over around every step")
    add_weight_sync_args(parser, defaults=False)  # weight sync: --weight-sync-* flags override the YAML
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[trainer] %(message)s")
    logging.getLogger("megatron_sync").setLevel(logging.INFO)  # weight sync: session, admissions, refusals
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    from examples.tiny.train import train_step

    # weight sync: this example syncs the initial weights unless the YAML says sync_on_start: false
    config = WeightSyncConfig.from_yaml(args.config, defaults={"sync_on_start": True}).replace(**explicit_flags(args))
    model, optimizer, vocab_size = build_model(config.require_family(), args.seed, args.rotary_base)
    layout = ParallelLayout.from_megatron()
    # weight sync: collective on every trainer rank; connects to the engines, checks the model, and (with
    # sync_on_start) sends the initial weights as version 1. Leaving the block (also on SIGTERM / SIGINT)
    # tells the engines to stop.
    memory = TrainerMemory(model, optimizer, rank=dist.get_rank()) if args.handoff else None  # weight sync
    with WeightSyncCallback.from_config(config, model, layout=layout, memory=memory) as callback:
        for step in range(args.steps):
            if args.handoff:
                to_training = callback.to_training()  # weight sync: the engines' memory to the trainer
            tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = train_step(model, optimizer, tokens, layout)
            metrics = callback.after_optimizer_step(update_successful=True)  # weight sync
            if dist.get_rank() == 0:
                print(f"[custom loop] step {step + 1}: loss {loss:.4f}, synced version "
                      f"{metrics.version if metrics else '-'}", flush=True)
                if args.handoff:
                    print(f"[custom loop] handoff: {_handoff_summary(to_training + callback.handoff_rows)}", flush=True)
    dist.destroy_process_group()
    return 0


def _handoff_summary(rows) -> str:
    """One line: per role and rank, what changed hands (rows of steps with nothing to do are left out)."""
    steps = [(r, phase) for r in rows for phase in ("release", "restore") if r.phases[phase] > 0]
    return "; ".join(f"{r.role} {r.rank} {phase} {r.bytes / 2**20:.2f} MiB in {r.phases[phase] * 1e3:.1f} ms"
                     for r, phase in steps)


if __name__ == "__main__":
    sys.exit(main())
