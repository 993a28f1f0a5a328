"""A Megatron trainer job and a fleet of reference-engine jobs, each engine its own launched job, for tests.

The trainer (`fleet_trainer_job`, a tiny Megatron model under `case["layout"]`) trains and syncs
`case["versions"]` versions through `TrainerWeightSync` with `weight_sync.fleet`; before version v its
leader waits until the engines in `case["await"][v]` ({engine: generation}) were admitted, so a test
that restarts an engine knows which version it rejoins at. Every engine (`fleet_engine_job`) is one
`megatron_sync.drivers.serve.join` job of `engine_tp` ranks with its own `engine_id`; it serves until "stop"
and returns, per version it committed, its shards and logits. Faults, per engine job:
`case["die_after"] = v` (every rank exits right after committing v: killed between syncs) and
`case["die_during"] = (v, rank)` (that rank exits a few tensors into version v: killed mid-sync).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from megatron_sync.core.wait import poll
from tests.support.jobs import EVAL_TOKENS, _sent_here, _setup, case_hf_config, megatron_trainer, sync_config
from tests.support.timing import scaled

KILLED = 17  # the exit code of a rank killed on purpose


def fleet_trainer_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """Train and sync; return per version what the leader sent, the trainer's logits and the fleet's rows."""
    from megatron_sync.drivers.callback import WeightSyncCallback
    from tests.support import models
    from tests.support.train import train_step

    spec, chunks, layout, ddp, optimizer = megatron_trainer(case)
    sent, logits, rows = [], [], []
    with WeightSyncCallback.from_config(sync_config(case), ddp, hf_config=case_hf_config(case), layout=layout,
                                        keep_sent=True) as callback:  # the tests compare engines with what was sent
        syncer = callback.syncer
        for version in range(1, case["versions"] + 1):
            if version > 1:
                tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(version))
                train_step(ddp, optimizer, tokens, layout)
            if syncer.is_leader:
                await_admitted(syncer.session, case.get("await", {}).get(version, {}),
                               case.get("timeout_s", 60.0) * 3)
            metrics = syncer.sync()
            rows.append(metrics.fleet)
            logits.append(models.megatron_logits(chunks, EVAL_TOKENS))
            sent.append(_everyones(_sent_here(syncer)))
    return {"sent": sent, "logits": logits, "fleet": rows}


def _everyones(mine: dict) -> dict:
    """Return what every trainer rank sent, merged (a P2P rank sends pieces of some tensors only)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: tensor for part in everyone for name, tensor in part.items()}


def await_admitted(session: Any, engines: dict[int, int], timeout_s: float) -> None:
    """Wait until the trainer's sync `session` admitted every engine of `engines` (engine -> generation) at
    that generation or later; TimeoutError naming who was admitted after `timeout_s` (scaled for load)."""
    limit = scaled(timeout_s)

    def admitted() -> bool:
        return all(session.admitted_engines().get(e, (-1, ""))[0] >= g for e, g in engines.items())

    poll(admitted, within=limit, what=f"engines {engines} being admitted", timeout=lambda _: TimeoutError(
        f"engines {engines} were not admitted within {limit:g}s: {session.admitted_engines()}"))


def fleet_engine_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """One engine of the fleet: serve until "stop"; return per committed version this rank's shards and logits."""
    _setup(case)
    from megatron_sync.drivers.serve import join
    from megatron_sync.drivers.sync import InferenceWeightSync
    from megatron_sync.session.control import ControlOp

    config = sync_config(case).replace(engine_id=case["engine_id"])
    me = join(config, case_hf_config(case))
    _inject_faults(me.engine, rank, case)
    isync = InferenceWeightSync(config, me.engine, num_trainer_stages=case["layout"].get("pp", 1),
                                inference_rank=me.rank, engine_group=me.group, hf_config=me.hf_config,
                                job_id=me.job_id)
    held, failure, generation = [], None, isync.session.generation
    try:
        while True:
            message = isync.next_control(timeout_s=case.get("timeout_s", 60.0) * 3)
            if not isync.handle(message, {}):
                break
            if message.op in (ControlOp.SYNC, ControlOp.RELAY_RECEIVE):
                staging = getattr(isync.receiver, "staging", None)  # a P2P or bucket receiver's sets
                held.append({"version": me.engine.version, "shards": me.engine.snapshot(),
                             "logits": me.engine.logits(EVAL_TOKENS),
                             "staging_sets": None if staging is None else staging.count})
                if me.engine.version == case.get("die_after"):
                    os._exit(KILLED)
    except Exception as e:  # noqa: BLE001 — what the test reads
        failure = {"type": type(e).__name__, "text": traceback.format_exc(), "version": me.engine.version,
                   "shards": me.engine.snapshot()}
    finally:
        isync.close()
    return {"held": held, "failure": failure, "generation": generation}


def _inject_faults(engine: Any, rank: int, case: dict) -> None:
    """`case["die_during"] = (version, rank)`: that rank exits after staging 2 tensors of `version`;
    `case["die_forwarding"] = version`: every rank exits right after forwarding its first round of it (p2p)."""
    if case.get("die_forwarding") is not None:
        _die_forwarding(engine, case["die_forwarding"])
    if case.get("die_during") is None:
        return
    from tests.support.fakes import FaultyLayout

    version, dying_rank = case["die_during"]
    if rank != dying_rank:
        return
    staged = {}

    def before_write(n: int) -> None:
        target = engine.version + 1
        staged[target] = staged.get(target, 0) + 1
        if target == version and staged[target] > 2:
            os._exit(KILLED)

    faulty = FaultyLayout.wrap(engine.rank_layout(), before_write)
    engine.rank_layout = lambda: faulty


def _die_forwarding(engine: Any, version: int) -> None:
    from megatron_sync.transports.p2p.rounds import RoundReceiver

    forward = RoundReceiver._forward

    def dying(self, round_, route, pieces, sums, at):
        moved = forward(self, round_, route, pieces, sums, at)
        if engine.version + 1 == version:
            os._exit(KILLED)  # the rank behind this one got round 0 and waits for the rest
        return moved

    RoundReceiver._forward = dying


def reference_fleet_engine(rank: int, world_size: int, settings: dict, spec: Any, engine_id: int) -> dict:
    """A reference engine of one rank joining a fleet as `engine_id` beside driven engines (the trainer's
    `settings`, without its `engines`); serve until "stop"; return per committed version its shards."""
    import uuid

    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.drivers.sync import InferenceWeightSync
    from megatron_sync.session.control import ControlOp
    from tests.support.real_engines import tiny_hf_config

    config = WeightSyncConfig.from_dict({**settings, "engines": [], "engine_id": engine_id})
    hf = tiny_hf_config(spec)
    engine = ReferenceEngine(hf, tp_rank=0, tp_size=1)
    isync = InferenceWeightSync(config, engine, num_trainer_stages=1, inference_rank=0, hf_config=hf,
                                job_id=f"reference{engine_id}-{uuid.uuid4().hex[:6]}")
    held = []
    try:
        while True:
            message = isync.next_control(timeout_s=config.timeout_s * 3)
            if not isync.handle(message, {}):
                break
            if message.op in (ControlOp.SYNC, ControlOp.RELAY_RECEIVE):
                held.append({"version": engine.version, "shards": engine.snapshot()})
    finally:
        isync.close()
    return {"held": held}
