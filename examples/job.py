"""The example jobs' YAML (the format of configs/*.yaml) and their torchrun set-up.

Sections: `model` (family and sizes of the tiny CPU model), `trainer`
(Megatron's parallel layout), `train` (steps and data), `verify` (what the
demo checks after each sync) and `weight_sync` (the library's own settings,
`WeightSyncConfig`). Command-line `--weight-sync-*` flags override the YAML.
The whole file is validated when it is loaded (unknown keys, wrong types, and
sections that do not fit each other), so the demo refuses a bad file before
it launches anything. This is harness, not library: a production job reads
`weight_sync:` with `WeightSyncConfig.from_yaml` and builds its own model.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import yaml

from megatron_sync.settings.config import WeightSyncConfig, add_weight_sync_args, explicit_flags, field_names
from megatron_sync.core.lifecycle import Terminated


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """Megatron parallel sizes of the trainer job; DP is what the world size leaves over."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"trainer.world_size={self.world_size} is not a multiple of tp*pp={self.tp * self.pp}"
            )
        etp = self.etp or self.tp
        if self.world_size % (etp * self.ep * self.pp):
            raise ValueError(
                f"trainer.world_size={self.world_size} is not a multiple of etp*ep*pp={etp * self.ep * self.pp}"
            )


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How long and on what the demo trains."""

    steps: int = 3
    lr: float = 1e-3
    batch_size: int = 2
    seq_len: int = 16
    seed: int = 1234
    tensorboard_dir: str | None = None  # when set, trainer rank 0 writes each sync's figures there (TensorBoard)


@dataclass(frozen=True, kw_only=True)
class VerifySettings:
    """What is checked after each sync."""

    logits: bool = True
    logits_atol: float = 1e-4
    eval_batch: int = 2
    eval_seq_len: int = 12
    dump_dir: str | None = None  # when set, trainer and engines dump what they sent / hold
    rollout_tokens: int = 0  # > 0: engines generate this many tokens while the next sync arrives
    rollout_switch_step: int = 4  # the engines take the next sync in after this many tokens


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: dict[str, Any]
    trainer: TrainerLayout
    train: TrainSettings = field(default_factory=TrainSettings)
    verify: VerifySettings = field(default_factory=VerifySettings)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def model_spec(self):
        from examples.tiny.models import ModelSpec

        return ModelSpec(**self.model)

    @classmethod
    def load(cls, path: str, overrides: dict[str, Any] | None = None) -> "JobConfig":
        """Read and validate a whole job YAML; `overrides` replace `weight_sync` keys (--weight-sync-* flags).

        Every section is checked here, before any job is launched: unknown keys
        and values of the wrong type name the key, and the sections are checked
        against each other (`check_layouts`). `weight_sync.family` may be left
        out: it is the `model:` section's family (stated once, in one file), and
        a different one is an error. `weight_sync.sync_on_start` defaults to true
        here (the demo's engines start from zeros and take version 1 from the
        trainer's initial weights).
        """
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: a job YAML is a mapping of sections {sorted(SECTIONS)}")
        unknown = sorted(set(doc) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{path}: unknown sections {unknown}; valid sections are {sorted(SECTIONS)}")
        model = _mapping(doc, "model", path)
        if "family" not in model:
            raise ValueError(f"{path}: the 'model:' section must name a 'family' (e.g. family: qwen3)")
        sync_values = {**_mapping(doc, "weight_sync", path), **(overrides or {})}
        sync_values.setdefault("family", model["family"])
        sync_values.setdefault("sync_on_start", True)  # the demo's engines start from zeros
        if sync_values["family"] != model["family"]:
            raise ValueError(
                f"{path}: weight_sync.family={sync_values['family']!r} but model.family is "
                f"{model['family']!r}; drop weight_sync.family or make them agree"
            )
        try:
            weight_sync = WeightSyncConfig.from_dict(sync_values)
        except ValueError as e:
            raise ValueError(f"{path}: weight_sync: {e}") from None
        _typed(_model_spec_type(), model, "model", path)
        job = cls(
            model=dict(model),
            trainer=_section(TrainerLayout, doc, "trainer", path),
            train=_section(TrainSettings, doc, "train", path),
            verify=_section(VerifySettings, doc, "verify", path),
            weight_sync=weight_sync,
        )
        try:
            job.check_layouts()
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return job

    def check_layouts(self) -> None:
        """Raise ValueError naming the keys when the model, the trainer layout and the engines do not fit."""
        try:
            spec = self.model_spec()
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"model: {e}") from None
        t, ws = self.trainer, self.weight_sync
        layers_per_stage = t.pp * (t.vpp or 1)
        checks = [
            (spec.num_heads % t.tp == 0, f"trainer.tp={t.tp} must divide model.num_heads={spec.num_heads}"),
            (spec.num_kv_heads % t.tp == 0 or t.tp % spec.num_kv_heads == 0,
             f"trainer.tp={t.tp} and model.num_kv_heads={spec.num_kv_heads}: one must divide the other"),
            (spec.num_layers % layers_per_stage == 0,
             f"model.num_layers={spec.num_layers} must divide into trainer.pp*vpp={layers_per_stage} stages"),
            (not spec.is_moe or spec.num_experts % t.ep == 0,
             f"trainer.ep={t.ep} must divide model.num_experts={spec.num_experts}"),
            (spec.is_moe or t.ep == 1, f"trainer.ep={t.ep} needs a mixture-of-experts model.family, not "
                                       f"{spec.family!r}"),
            (spec.num_heads % ws.engine_tp_size == 0,
             f"weight_sync.engine_tp_size={ws.engine_tp_size} must divide model.num_heads={spec.num_heads}"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))


SECTIONS = ("model", "trainer", "train", "verify", "weight_sync")


def deaf_to_stop_signals() -> None:
    """Fault injection (for the test suite): from now on SIGTERM / SIGINT do nothing in Python, wherever the kernel
    delivers them, as in a rank blocked in native code. (Blocking them in the calling thread alone is not
    deaf: another thread takes the signal and the main thread runs the handler at its next bytecode.) The
    library's stop watchdog still hears them through the signal wakeup fd, which is what such a test checks."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)


def _model_spec_type():
    from examples.tiny.models import ModelSpec

    return ModelSpec


def _mapping(doc: dict, name: str, path: str) -> dict:
    values = doc.get(name) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: '{name}:' must be a mapping of keys, got {type(values).__name__}")
    return values


def _section(kind, doc: dict, name: str, path: str):
    values = _mapping(doc, name, path)
    _typed(kind, values, name, path)
    try:
        return kind(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {name}: {e}") from None


def _typed(kind, values: dict, name: str, path: str) -> None:
    """Check `values` against `kind`'s fields: unknown keys and wrongly typed values name the key."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown} in '{name}:'; valid keys are {sorted(fields)}")
    for key, value in values.items():
        allowed = _ANNOTATION_TYPES.get(str(fields[key].type).replace(" ", ""))
        if allowed is not None and not _is_instance(value, allowed):
            raise ValueError(f"{path}: {name}.{key}={value!r} must be {fields[key].type}")


_ANNOTATION_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                     "int|None": (int, type(None)), "float|None": (int, float, type(None)),
                     "str|None": (str, type(None))}


def _is_instance(value: Any, allowed: tuple) -> bool:
    if isinstance(value, bool) and bool not in allowed:
        return False  # yaml's true/false is not a number
    return isinstance(value, allowed)


def job_arg_parser(description: str) -> argparse.ArgumentParser:
    """Return a parser with --config and every --weight-sync-* flag (unset flags stay None)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="job YAML (see configs/)")
    parser.add_argument("--harness-port", type=int, default=0,
                        help="the demo's own store (logits, rollouts), hosted by the demo driver")
    add_weight_sync_args(parser, defaults=False)
    return parser


def load_job(args: argparse.Namespace) -> JobConfig:
    """Return the job config from parsed args: the YAML, with explicit flags on top."""
    return JobConfig.load(args.config, explicit_flags(args))


def job_argv(args: argparse.Namespace) -> list[str]:
    """Return the command-line arguments that reproduce `args`' job (for launching sub-jobs)."""
    argv = ["--config", args.config, "--harness-port", str(args.harness_port)]
    for name in field_names():
        value = getattr(args, f"weight_sync_{name}")
        flag = "--weight-sync-" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def run_under_torchrun(role: str, args: argparse.Namespace, run: Callable[[JobConfig], int]) -> NoReturn:
    """Set up one torchrun process of a job (rank-prefixed logs, gloo world) and exit with `run`'s code.

    The environment (RANK, WORLD_SIZE, MASTER_*) is torchrun's; this is the
    edge where it is read.
    """
    import datetime
    import logging
    import os
    import sys

    import torch
    import torch.distributed as dist

    job = load_job(args)
    logging.basicConfig(level=logging.WARNING, format=f"[{role} rank {os.environ.get('RANK', '?')}] %(message)s")
    logging.getLogger("megatron_sync").setLevel(logging.INFO)
    torch.set_num_threads(1)
    # The job's own collectives (Megatron's, the trainer's agreement rounds) wait at most a few
    # weight-sync timeouts rather than torch's default 30 minutes, so a dead rank ends the job.
    timeout = datetime.timedelta(seconds=max(120.0, 4 * job.weight_sync.timeout_s))
    dist.init_process_group("gloo", timeout=timeout)
    try:
        code = run(job)
    except Terminated as e:  # the library already told the other job; no traceback for a requested stop
        print(f"[{role} rank {dist.get_rank()}] stopped by {e}", flush=True)
        code = e.exit_code
    finally:
        dist.destroy_process_group()
    # Everything is reported and every group is shut down: leave without the interpreter's teardown, in which
    # a C++ thread of torch's distributed runtime was once destroyed while joinable ("terminate called
    # without an active exception", SIGABRT after a passed run; seen once in CI, not reproduced here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def harness_store(port: int, *, host: bool = False, timeout_s: float = 60.0) -> Any:
    """Return the demo's own TCP store on loopback (`host`: the demo driver serves it).

    The demo's checks (engine logits, rollout reports) travel here, not through
    the library's control channel.
    """
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=host, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
