"""The inference job: engine ranks around a named engine that receive every sync from the trainer.

Run one process per inference rank under torchrun (see launch/serve.sh):

    torchrun --nproc-per-node 2 -m megatron_sync.drivers.serve --engine reference --model-dir /models/qwen3 \\
        --config train.yaml        # or --weight-sync-* flags; the trainer's layout is adopted at the rendezvous

The model directory holds the inference model's `config.json` and, optionally,
its initial `*.safetensors` (without them the engine starts from zeros and
serves nothing useful until the trainer's first sync). Ranks form engines of
`weight_sync.engine_tp_size` consecutive ranks. The job follows the trainer's
control messages until the trainer says stop, then exits 0 on the version it
holds; SIGTERM makes every rank report the version it holds and exit, within
`STOP_GRACE_S` even when it is blocked in a collective. An engine that fails
while starting reports its error to the trainer's rendezvous first.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_sync.settings.config import WeightSyncConfig, add_weight_sync_args, explicit_flags
from megatron_sync.core.errors import PeerFailureError, RendezvousError, SyncStoppedError, TrainerGoneError
from megatron_sync.core.lifecycle import Terminated, stop_on_signals
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.drivers.inference_sync import AppHandler, InferenceWeightSync
from megatron_sync.transports import get_transport
from megatron_sync.session.rendezvous import Identity
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import report_failure

log = logging.getLogger("megatron_sync")


@dataclass
class EngineRank:
    """This process's place in the inference job: its engine and that engine's group."""

    rank: int
    world_size: int
    engine_index: int
    tp_rank: int
    group: Any
    engine: Any
    hf_config: Any = None  # the engine's model config, which the rendezvous compares with the trainer's
    job_id: str = ""  # shared by every rank of this inference job


STOP_GRACE_S = 3.0
"""After SIGTERM / SIGINT, how long a rank blocked in a collective may take to unwind before it reports
its version and exits anyway."""


def engine_groups(world_size: int, tp: int) -> Any:
    """Create one process group per engine (collective: every rank creates all); return this rank's."""
    mine = None
    for first in range(0, world_size, tp):
        ranks = list(range(first, first + tp))
        group = dist.new_group(ranks)  # also for tp=1: the engine's step agreement is per engine
        if dist.get_rank() in ranks:
            mine = group
    return mine


def build_reference_engine(hf_config: Any, config: WeightSyncConfig, *, tp_rank: int, group: Any) -> Any:
    """Return this rank's `ReferenceEngine` for `hf_config` (transformers on CPU, its own TP)."""
    from megatron_sync.engines.reference.engine import ReferenceEngine

    return ReferenceEngine(hf_config, tp_rank=tp_rank, tp_size=config.engine_tp_size, group=group,
                           dtype=dtype_from_name(config.dtype), family=config.require_family(),
                           draft=config.draft == "sync")


ENGINES: dict[str, Callable[..., Any]] = {"reference": build_reference_engine}
"""Engines this job can host, by name. vLLM runs in its own server (launch/serve_vllm.sh)."""


def load_initial_weights(engine: Any, model_dir: str) -> int:
    """Load the model directory's safetensors into `engine` as version 0; return how many tensors."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return 0
    full: dict[str, torch.Tensor] = {}
    for path in files:
        full.update(load_file(path))
    expected = {m.name for m in engine.expected_tensors()}
    missing, extra = sorted(expected - set(full)), sorted(set(full) - expected)
    if missing or extra:
        raise ValueError(f"{model_dir}: the safetensors do not match the engine's tensors: missing "
                         f"{missing[:8]}, unexpected {extra[:8]}; use the checkpoint of this config.json")
    engine.load_shards({name: t.clone() for name, t in engine.rank_layout().params_from(full).items()}, 0)
    return len(expected)


def shared_job_id() -> str:
    """Return an id rank 0 draws for this inference job, the same on every rank (collective)."""
    box = [f"inference-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def join(config: WeightSyncConfig, hf_config: Any, *, engine: str = "reference",
         model_dir: Optional[str] = None) -> EngineRank:
    """Build this torchrun process's engine (the default process group must exist).

    A failure while building (a config the engine cannot serve, a wrong rank
    count) is printed at once, reported to the trainer's rendezvous (so the
    trainer fails at once quoting it; `report_failure` waits a bounded time for
    one to listen and says so when none does), and then raised.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    job_id = shared_job_id()
    try:
        if config.fleet and world != config.engine_tp_size:  # a fleet: one engine per job
            raise ValueError(
                f"the inference job has {world} ranks but a fleet's engine job holds one engine of "
                f"weight_sync.engine_tp_size={config.engine_tp_size} ranks; launch that many processes per engine")
        if not config.fleet and world != config.num_inference_ranks:
            raise ValueError(
                f"the inference job has {world} ranks but weight_sync.num_inference_ranks="
                f"{config.num_inference_ranks}; launch as many inference processes as the config says")
        if config.fleet and config.engine_id is None:
            raise ValueError("a fleet's engine job needs its engine id: set weight_sync.fleet.engine_id "
                             "(--weight-sync-fleet-engine-id N), the same N again when it restarts")
        if engine not in ENGINES:
            raise ValueError(f"--engine {engine!r} is not hosted by this job; use one of {sorted(ENGINES)}")
        tp = config.engine_tp_size
        group = engine_groups(world, tp)
        engine_index, tp_rank = divmod(rank, tp)
        if config.fleet:
            engine_index = config.engine_id
        built = ENGINES[engine](hf_config, config, tp_rank=tp_rank, group=group)
        if model_dir is not None:
            load_initial_weights(built, model_dir)
    except Exception as e:
        print(f"[inference rank {rank}] failed while starting: {type(e).__name__}: {e}", flush=True)
        me = Identity(job=job_id, role="inference", member=rank, session=config.run_id)
        reported = get_transport(config.transport).meets_at_store and report_failure(
            config.master_address, config.master_port, me, f"{type(e).__name__}: {e}", timeout_s=config.timeout_s,
            secret=SessionSecret.from_environment())
        print(f"[inference rank {rank}] its start-up failure was " + ("reported to the trainer" if reported else
              f"not reported: the trainer's rendezvous at {config.master_address}:{config.master_port} could not "
              "be reached"), flush=True)
        raise
    return EngineRank(rank, world, engine_index, tp_rank, group, built, hf_config, job_id)


def serve(me: EngineRank, config: WeightSyncConfig, *, num_trainer_stages: Optional[int] = None,
          handlers: Optional[dict[str, Callable[[InferenceWeightSync, Any], AppHandler]]] = None,
          on_stop: Optional[Callable[[], None]] = None) -> int:
    """Follow the trainer until "stop"; return the exit code. `handlers[name](isync, message)` serve app messages.

    0: the trainer said stop, also in the middle of a sync (the engine holds its last version, a sync under way
    is abandoned); 1: the trainer went away, a peer died or fell silent mid-sync, or the rendezvous refused this
    rank (the message says which); 128 + signum: SIGTERM / SIGINT, also when the rank was blocked (after
    `STOP_GRACE_S`) or while it was leaving. Every way out prints the version held, after `on_stop()`."""
    stopping = on_stop if on_stop is not None else (lambda: None)

    def say(how: str) -> None:
        stopping()
        print(f"[inference rank {me.rank}] {how}; the engine stays on version {me.engine.version}", flush=True)

    with stop_on_signals(grace_s=STOP_GRACE_S, report=lambda what: say(f"stopped by {what}")) as stop:
        try:
            isync = InferenceWeightSync(config, me.engine, num_trainer_stages=num_trainer_stages,
                                        inference_rank=me.rank, engine_group=me.group, hf_config=me.hf_config,
                                        job_id=me.job_id)
        except RendezvousError as e:
            say(f"could not join the trainer: {e}")
            return 1
        except Terminated as e:
            say(f"stopped by {e} while joining")
            return e.exit_code
        bound = {name: (lambda message, make=make: make(isync, message)) for name, make in (handlers or {}).items()}
        why = ""  # why this rank leaves, when the trainer did not say stop
        try:
            isync.serve(bound)
        except SyncStoppedError as e:  # stopped mid-sync: the transfer was abandoned, the version kept
            ended = str(e)
        except Terminated as e:
            say(why := f"stopped by {e}")
            return _leave(isync, why, say, e.exit_code)
        except Exception as e:  # noqa: BLE001 — _exit_after says it and picks the exit code, or raises it again
            why = f"{type(e).__name__}: {e}"
            try:
                code = _exit_after(e, stop.as_exception(), say, stopping, me.rank)
            except BaseException:
                _leave(isync, why, say, None)
                raise
            return _leave(isync, why, say, code)
        else:
            ended = "the trainer ended the session" + (f": {isync.stop_reason}" if isync.stop_reason else "")
        if (signalled := _leave(isync, why, say, None)) is not None:
            return signalled
    stopping()
    print(f"[inference rank {me.rank}] stopped on version {me.engine.version} ({ended})", flush=True)
    return 0


def _leave(isync: InferenceWeightSync, why: str, say: Callable[[str], None], code: Optional[int]) -> Optional[int]:
    """Close the rank's weight sync and return `code`; a signal that arrives meanwhile (torchrun stopping this
    rank because a sibling exited while this one waits on a silent trainer) is said, with the version held,
    and its exit code returned instead."""
    try:
        isync.close(why)
    except Terminated as e:
        say(f"stopped by {e} while leaving")
        return e.exit_code
    return code


def _exit_after(error: Exception, signalled: Optional[Terminated], say: Callable[[str], None],
                stopping: Callable[[], None], rank: int) -> int:
    """Return the exit code of an inference rank that `error` ended (saying why), or raise it when it is not an
    end the rank can name: `signalled` is the signal that came first, if one did (the error is its consequence)."""
    if signalled is not None:
        say(f"stopped by {signalled} ({type(error).__name__} while unwinding)")
        return signalled.exit_code
    if isinstance(error, TrainerGoneError):
        stopping()
        print(f"[inference rank {rank}] {error}", flush=True)
        return 1
    if isinstance(error, PeerFailureError):  # a peer died or fell silent mid-sync: the message names it
        say(str(error))
        return 1
    say(f"stopped by {type(error).__name__}: {error}")
    raise error


def arg_parser(description: str = "megatron-sync inference job (run under torchrun)") -> argparse.ArgumentParser:
    """Return the job's parser: --engine, --model-dir, --trainer-stages, --config and --weight-sync-*."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--engine", default="reference", help=f"one of {sorted(ENGINES)}")
    parser.add_argument("--model-dir", required=True, help="HF model directory: config.json [+ *.safetensors]")
    parser.add_argument("--trainer-stages", type=int, default=None,
                        help="pipeline stages of the trainer job; leave it out: the trainer states it at the "
                             "rendezvous (disk_delta: in its directory session)")
    parser.add_argument("--config", help="YAML whose weight_sync: section holds the settings (flags override)")
    add_weight_sync_args(parser, defaults=False)
    return parser


def config_from_args(args: argparse.Namespace) -> WeightSyncConfig:
    """Return the settings: the YAML's weight_sync: section (if any) with explicit flags on top."""
    base = WeightSyncConfig.from_yaml(args.config) if args.config else WeightSyncConfig()
    return base.replace(**explicit_flags(args))


def with_model_family(config: WeightSyncConfig, hf_config: Any) -> WeightSyncConfig:
    """Return `config` with `family` set: as given, else the family that declares config.json's model_type.

    Not a default: the family is read from the model being served (each family
    declares its `hf_model_types` in megatron_sync.convert/), it is logged, and the
    rendezvous refuses the join if it differs from the trainer's explicit one.
    """
    if config.family is not None:
        return config
    from megatron_sync.convert import UnknownFamilyError, family_of_model_type

    model_type = getattr(hf_config, "model_type", None)
    try:
        family = family_of_model_type(model_type).name
    except UnknownFamilyError as e:
        raise ValueError(f"{e}: set weight_sync.family (or --weight-sync-family) to the family being trained") from None
    log.info("weight_sync.family not set: serving family %r, which converts config.json's model_type %r "
             "(the trainer's family is checked against it at the rendezvous)", family, model_type)
    return config.replace(family=family)


def load_model_config(model_dir: str) -> Any:
    """Return the transformers config of `model_dir`'s config.json; a model type transformers has no class for
    but a family converts (Kimi-K2's "kimi_k2") is read with its family's config class (`config_model_type`)."""
    import json

    from transformers import AutoConfig

    from megatron_sync.convert import config_model_type

    with open(os.path.join(model_dir, "config.json")) as f:
        values = json.load(f)
    model_type = values.get("model_type")
    if model_type is None or config_model_type(model_type) == model_type:
        return AutoConfig.from_pretrained(model_dir)
    return AutoConfig.for_model(config_model_type(model_type), **{k: v for k, v in values.items() if k != "model_type"})


def main(argv: Optional[list[str]] = None) -> int:
    args = arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[inference rank {os.environ.get('RANK', '?')}] %(message)s")
    logging.getLogger("megatron_sync").setLevel(logging.INFO)
    config = config_from_args(args)
    hf_config = load_model_config(args.model_dir)
    config = with_model_family(config, hf_config)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(120.0, 4 * config.timeout_s)))
    try:
        me = join(config, hf_config, engine=args.engine, model_dir=args.model_dir)
        return serve(me, config, num_trainer_stages=args.trainer_stages)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
