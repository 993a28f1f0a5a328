"""A trainer job and an inference job run side by side through the library's drivers, for tests.

`run_pair(case)` starts both as separate spawned gloo jobs that meet only at the
weight-sync rendezvous, like the real launched jobs: the trainer builds a tiny
Megatron model (`case["spec"]` under `case["layout"]`), syncs `case["versions"]`
versions through `TrainerWeightSync` with a training step between them, and
returns what it sent; the engines (`ReferenceEngine` via `megatron_sync.drivers.serve.join`)
serve through `InferenceWeightSync` until "stop" and return their shards and
logits per version. `case["imports"]` names modules each process imports
first (a test that registers its own family or transport). `case["quantization_config"]`
goes into both jobs' HF config (the trainer quantizes, the engine dequantizes);
with `case["record_unquantized"]` the trainer also returns, per version, the
same gather and conversion without quantization (the reference quantizers' input).
With `case["record_failures"]` a job returns what failed instead of raising: the
trainer goes on after a sync every rank agreed to abort (the next step syncs
the same version number again) and stops at any other error; an engine rank
stops at its first error and returns the shards it holds then. With
`case["fails_within_s"] = {"trainer": s, "engine": s}` every sync of that job
that fails must fail within s (scaled for load) of its start, else the rank
raises `BoundExceeded` (a failure that waited out a longer timeout).
`run_pair(..., outcomes=True)` returns every rank's outcome, so a test can kill
ranks on purpose. With `case["draft_logits"]` both jobs also return, per version, the
draft (multi-token-prediction) layers' logits: the trainer Megatron's MTP head, the
engine its own draft forward. `case["keep_tensors"] = False` returns versions and metrics
only (benchmarks).
"""

from __future__ import annotations

import importlib
import urllib.request
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from megatron_sync.core.wait import Deadline, poll
from tests.support.dist import free_port, run_distributed, run_ranks
from tests.support.timing import BoundExceeded, scaled

EVAL_TOKENS = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(7))


def sync_config(case: dict):
    """Return the WeightSyncConfig both jobs of `case` use."""
    from megatron_sync.settings.config import WeightSyncConfig

    return WeightSyncConfig.from_dict({
        "family": case["spec"]["family"], "master_port": case["port"], "timeout_s": case.get("timeout_s", 60.0),
        "num_inference_ranks": case["engines"] * case["engine_tp"], "engine_tp_size": case["engine_tp"],
        "bucket_size_mb": case.get("bucket_size_mb", 0.25), "dtype": "float32", "backend": "gloo",
        **case.get("weight_sync", {}),
    })


def _setup(case: dict) -> None:
    os.environ.update(case.get("env", {}))  # e.g. UCX_TLS for NIXL, read when its agent starts
    for module in case.get("imports", ()):
        importlib.import_module(module)


def case_hf_config(case: dict):
    """Return the HF config both jobs of `case` use: the tiny model's, with the case's quantization_config."""
    from tests.support import models

    config = models.hf_config(models.ModelSpec(**case["spec"]))
    if case.get("quantization_config") is not None:
        config.quantization_config = case["quantization_config"]
    return config


def _unquantized_hf_tensors(chunks: list, layout, case: dict) -> dict[str, torch.Tensor]:
    """Return the HF tensors of the chunks' current weights, gathered and converted like a sync but not
    quantized (collective over the trainer job; the stage source gets them)."""
    from megatron_sync.convert import get_converter
    from megatron_sync.core.meta import dtype_from_name
    from megatron_sync.trainer.stream import MegatronWeightStream

    config = sync_config(case)
    converter = get_converter(config.family, {**case_hf_config(case).to_dict(), "quantization_config": None},
                              dtype=dtype_from_name(config.dtype))
    return {name: t.clone() for name, t in MegatronWeightStream(chunks, layout, converter)}


def megatron_trainer(case: dict) -> tuple:
    """Build the trainer of `case` on this rank: (spec, chunks, layout, ddp, optimizer), the tiny Megatron
    model of `case["spec"]` under `case["layout"]` with the reference weights of seed 3."""
    _setup(case)
    from megatron_sync.core.grid import ParallelLayout
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, wrap_in_ddp

    init_megatron(**{k: v for k, v in case["layout"].items() if k != "dp"}, seed=3)  # Megatron infers dp
    spec = models.ModelSpec(**case["spec"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    layout = ParallelLayout.from_megatron()
    ddp = wrap_in_ddp(chunks)
    return spec, chunks, layout, ddp, make_optimizer(ddp, lr=1e-3)


def trainer_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """Train and sync; return {"sent": [{name: tensor} per version] (leader), "logits": [...]}."""
    from megatron_sync.drivers.callback import WeightSyncCallback
    from megatron_sync.engines.handoff import TrainerMemory
    from megatron_sync.transports.p2p.sender import P2PSender
    from tests.support import models
    from tests.support.train import train_step

    from tests.support.gather_spy import GatherBytes, scheduled_gather_bytes

    spec, chunks, layout, ddp, optimizer = megatron_trainer(case)
    spy = GatherBytes(layout)
    sent, logits, unquantized, metrics, received, failures, draft_logits, handoffs = [], [], [], [], [], [], [], []
    raw: list[list[float]] = []
    raw_spans: list[list[float]] = []  # each raw replay's start and end, wall clock
    memory = TrainerMemory(ddp, optimizer, rank=rank) if case.get("handoff") else None
    with WeightSyncCallback.from_config(sync_config(case), ddp, hf_config=case_hf_config(case), layout=layout,
                                        memory=memory, keep_sent=case.get("keep_tensors", True)) as callback:
        syncer = callback.syncer
        for version in range(1, case["versions"] + 1):
            if version > 1:
                tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(version))
                if memory is not None:  # colocated: the engines release, the trainer takes its memory back
                    handoffs.append({"to_training": [r.to_json() for r in callback.to_training()]})
                train_step(ddp, optimizer, tokens, layout)
            limit = _failure_deadline(case, "trainer")
            try:
                if memory is not None and version > 1:  # hands the memory back to the engines, then syncs
                    metrics.append(callback.after_optimizer_step(True).to_json())
                    handoffs[-1]["to_generation"] = [r.to_json() for r in callback.handoff_rows]
                else:
                    if case.get("aligned_start"):  # every rank starts the sync at once (the raw replays do too)
                        torch.distributed.barrier()
                    with spy.counting():
                        metrics.append(syncer.sync().to_json())
            except Exception as e:  # noqa: BLE001 — recorded for the test, or raised
                if not case.get("record_failures"):
                    raise
                _failed_in_time(case, limit, "trainer", e)
                failures.append({"step": version, "aborted": _aborted(e), "text": traceback.format_exc()})
                if _aborted(e):
                    continue
                break
            _hold_after(case, version)
            if case.get("keep_tensors", True):
                logits.append(models.megatron_logits(chunks, EVAL_TOKENS))
                sent.append(_sent_here(syncer))
            if case.get("draft_logits"):
                draft_logits.append(models.megatron_draft_logits(chunks, EVAL_TOKENS))
            if case.get("record_unquantized"):
                unquantized.append(_unquantized_hf_tensors(chunks, layout, case))
            if case.get("receiver_metrics") and syncer.is_leader:
                received.append([m.to_json() for m in syncer.receiver_metrics(syncer.version)])
            if case.get("raw_replays") and version > 1:  # the wire alone, the same messages, between two syncs
                raw.append(_replays(syncer.sender, case["raw_replays"], raw_spans))
        sender = syncer.sender
        if memory is not None:  # one more turn without a sync: the engines reload the version they hold
            handoffs.append({"to_training": [r.to_json() for r in callback.to_training()]})
            callback.after_optimizer_step(False)
            handoffs[-1]["to_generation"] = [r.to_json() for r in callback.handoff_rows]
    out = {"sent": sent, "logits": logits, "unquantized": unquantized, "metrics": metrics, "received": received,
           "failures": failures, "draft_logits": draft_logits, "handoffs": handoffs, "raw_s": raw,
           "raw_spans": raw_spans, "transport": syncer.config.transport,
           "bucket_size_mb": syncer.config.bucket_size_mb}
    if isinstance(sender, P2PSender):  # P2P: what this rank writes per version, and its arena
        out["share"] = {"arena": sender.arena.numel(), "scheduled": sender.schedule.bytes_from_sender()[rank],
                        "egress": sender.schedule.trainer_egress(), "busiest_over_mean":
                        sender.schedule.balance.busiest_over_mean(), "gather_peak": sender.stream.tracker.peak,
                        "largest": sender.stream.tracker.largest_tensor,
                        "gather_budget": sender.stream.gather_budget_bytes, "slots": sender.schedule.slots,
                        "rounds": max(sender.schedule.rounds), "gathered": spy.received,
                        "gather_scheduled": scheduled_gather_bytes(sender, rank)}
    return out


def _replays(sender: Any, count: int, spans: list[list[float]]) -> list[float]:
    """Return the seconds of `count` replays of the last version's writes by every trainer rank at once (from
    a barrier of the trainer job to the barrier after every rank's writes landed); add each replay's start and
    end (wall clock) to `spans`."""
    import time

    import torch.distributed as dist

    seconds = []
    for _ in range(count):
        dist.barrier()
        start, at = time.perf_counter(), time.time()
        sender.replay_last()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        spans.append([at, time.time()])
    return seconds


def _aborted(error: Exception) -> bool:
    """True when every trainer rank agrees the sync was aborted (the transport stays usable)."""
    from megatron_sync.core.errors import AgreedFailure

    return isinstance(error, AgreedFailure) and all(m.startswith("SyncAbortedError") for _, m in error.failures)


def _sent_here(syncer) -> dict[str, torch.Tensor]:
    """Return what this rank sent in the last sync: the full tensors of its P2P pieces, or (broadcast leader)
    its stage's buckets."""
    replica = getattr(syncer.sender, "replica", None)
    if replica is None:  # P2P (one link or a fleet): the full tensors of the pieces this rank wrote
        return {name: t.clone() for name, t in (syncer.sender.sent_tensors() or {}).items()}
    if not syncer.is_leader:
        return {}
    return {e.name: replica.view(e.name).clone() for b in replica.buckets for e in b.entries}


def _hold_after(case: dict, version: int) -> None:
    """`case["hold"] = {"after_version": v, "until_file": path}`: after syncing v, wait until the test
    creates `path` (a test that does something between two syncs)."""
    hold = case.get("hold")
    if not hold or version != hold["after_version"]:
        return
    poll(lambda: os.path.exists(hold["until_file"]), within=scaled(case.get("timeout_s", 60.0) * 2),
         what=f"the test creating {hold['until_file']}", max_pause_s=0.1)


def _failure_deadline(case: dict, job: str) -> Optional[Deadline]:
    """Return when a sync of `job` ("trainer" / "engine") starting now must have failed by, if it fails
    (`case["fails_within_s"][job]`, scaled for load); None when the case bounds no failure of that job."""
    seconds = case.get("fails_within_s", {}).get(job)
    return None if seconds is None else Deadline.after(scaled(seconds))


def _failed_in_time(case: dict, limit: Optional[Deadline], job: str, error: BaseException) -> None:
    """Raise BoundExceeded when the sync of `job` that raised `error` failed after its deadline `limit`."""
    if limit is not None and limit.expired():
        bound = scaled(case["fails_within_s"][job])
        raise BoundExceeded(f"the {job}'s failed sync took longer than its bound of {bound:.3g}s (it waited out a "
                            f"longer timeout): {type(error).__name__}: {error}") from error


def _plant_after_load(engine: Any, rank: int, case: dict) -> None:
    """`case["corrupt_after_load"] = (version, rank, name)`: right after that rank loaded `version`, one byte of
    its live copy of HF tensor `name` changes (a fault no wire checksum can see: a load or post-processing bug)."""
    if case.get("corrupt_after_load") is None:
        return
    version, bad_rank, name = case["corrupt_after_load"]
    if rank != bad_rank:
        return
    load, planted = engine.load_shards, []

    def load_then_corrupt(shards, loaded_version):
        load(shards, loaded_version)
        if loaded_version == version and not planted:  # once: the next sync of that version loads cleanly
            planted.append(True)
            live = engine.loaded_params()[name]
            with torch.no_grad():
                live.view(-1).view(torch.uint8)[0] ^= 0x01

    engine.load_shards = load_then_corrupt


def _misconfigure_rope(engine: Any, case: dict) -> None:
    """`case["engine_rope_base"] = b`: the engine's rotary embedding uses base b instead of its config's (an
    engine computing differently with exact weights: what the canary's drift catches and no checksum can)."""
    base = case.get("engine_rope_base")
    if base is None:
        return
    for module in engine.model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            dim = 2 * inv_freq.numel()
            inv_freq.copy_(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))


def engine_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """Serve syncs until "stop"; return per committed version this rank's shards and the engine's logits."""
    _setup(case)
    from megatron_sync.drivers.serve import join
    from megatron_sync.drivers.sync import InferenceWeightSync
    from megatron_sync.session.control import ControlOp

    config = sync_config(case)
    me = join(config, case_hf_config(case))
    _plant_after_load(me.engine, me.rank, case)
    _misconfigure_rope(me.engine, case)
    # the trainer's pipeline stages are adopted at its rendezvous (disk_delta meets through files: told them)
    stages = case["layout"].get("pp", 1) if config.transport == "disk_delta" else None
    isync = InferenceWeightSync(config, me.engine, num_trainer_stages=stages,
                                inference_rank=me.rank, engine_group=me.group, hf_config=me.hf_config,
                                job_id=me.job_id)
    held, handoffs, failure, limit = [], [], None, _failure_deadline(case, "engine")
    try:
        while True:
            message = isync.next_control(timeout_s=case.get("timeout_s", 60.0) * 2)
            limit = _failure_deadline(case, "engine")
            if not isync.handle(message, {}):
                break
            if message.op is not ControlOp.SYNC:  # a memory handoff: can the engine compute now?
                handoffs.append({"op": message.op.value, "version": me.engine.version, "computes": _computes(me)})
                continue
            held.append({"version": me.engine.version, "shards": me.engine.snapshot(),
                         "logits": me.engine.logits(EVAL_TOKENS)} if case.get("keep_tensors", True)
                        else {"version": me.engine.version})
            held[-1]["in_place"] = me.engine.runs_in_place()  # bytes it computes with from the receiver's set
            if config.metrics_port:  # what a Prometheus server would scrape from this rank now
                url = f"http://127.0.0.1:{config.metrics_port + me.rank}/metrics"
                held[-1]["scraped"] = urllib.request.urlopen(url, timeout=30).read().decode()
            if case.get("draft_logits"):
                held[-1]["draft_logits"] = me.engine.draft_logits(EVAL_TOKENS)
    except Exception as e:  # noqa: BLE001 — recorded for the test, or raised
        if not case.get("record_failures"):
            raise
        _failed_in_time(case, limit, "engine", e)
        failure = {"type": type(e).__name__, "text": traceback.format_exc(), "version": me.engine.version,
                   "shards": me.engine.snapshot()}
    finally:
        isync.close()
    return {"held": held, "failure": failure, "handoffs": handoffs, "transport": isync.config.transport,
            "bucket_size_mb": isync.config.bucket_size_mb}


def _computes(me) -> bool:
    """True when the engine computes logits (False while its weights are released); collective over its ranks."""
    try:
        return bool(torch.isfinite(me.engine.logits(EVAL_TOKENS)).all())
    except RuntimeError:
        return False


def shards_not_sent(engines: list, sent: list[dict[str, torch.Tensor]], spec: dict) -> list[tuple[int, int, str]]:
    """Return (version index, TP rank, name) of every engine shard that is not exactly the reference engine's
    slice of the tensor the trainer sent (`engine_job` / `trainer_job` results of one engine of `spec`)."""
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.fakes import shard_of
    from tests.support.models import ModelSpec, hf_config

    config = hf_config(ModelSpec(**spec))
    wrong = []
    for tp_rank, engine in enumerate(engines):
        slicer = ReferenceEngine(config, tp_rank=tp_rank, tp_size=len(engines))
        for version, held in enumerate(engine["held"]):
            wrong += [(version, tp_rank, name) for name, shard in held["shards"].items()
                      if not torch.equal(shard, shard_of(slicer, name, sent[version][name]))]
    return wrong


def run_pair(case: dict, timeout: float = 240.0, *, trainer: Callable = trainer_job,
             engine: Callable = engine_job, outcomes: bool = False) -> tuple[Any, Any]:
    """Run the trainer job and the inference job of `case` concurrently; return both jobs' per-rank results.

    `trainer` / `engine` replace the job functions (module-level, with the same signatures).
    With `outcomes` every rank runs to its end whatever the others do, and each job's
    `{rank: (status, value)}` of `run_ranks` is returned (a killed rank reads "exited").
    """
    case = {"port": free_port(), "engines": 1, "engine_tp": 2, "layout": {}, "versions": 2, **case}
    trainer_world = _world(case["layout"])
    run = (lambda fn, world: run_ranks(fn, world, case, timeout=timeout)) if outcomes else \
        (lambda fn, world: run_distributed(fn, world, case, timeout=timeout))
    with ThreadPoolExecutor(max_workers=2) as pool:
        trainers = pool.submit(run, trainer, trainer_world)
        engines = pool.submit(run, engine, case["engines"] * case["engine_tp"])
        return trainers.result(), engines.result()


def _world(layout: dict) -> int:
    """The trainer world size of a layout: tp * pp * dp (dp 1 unless given), at least ep * etp * pp."""
    tp, pp, ep, dp = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), layout.get("dp", 1)
    etp = layout.get("etp") or tp
    return max(tp * pp * dp, ep * etp * pp)
