"""Benchmark: time until a whole fleet of engines serves a version, for 1, 2 and 4 engines, all at once, in waves
and relayed, in one run.

Per configuration (engines N, mode) one trainer process hosts the sync session and runs a `FleetDriver`
(`megatron_sync.fleet.trainer`) over a seeded float32 model of `--mb` MiB in 4 MiB tensors, and N engine
processes (each one fake engine of TP=1) each run `InferenceWeightSync.serve`, as `tests/support/fleet_fakes.py`
does with its small model. Every engine compares every tensor of every commit bit for bit with the reference
(a memcmp inside its commit, against tensors made before it joined); the trainer makes each version's tensors
before its sync, so neither side times the making of reference data. `--versions` + 1 syncs: the first is a
warm-up; medians over the others. Modes (the same settings on both sides):

- all at once: wave_size 0, every engine fed by the trainer in one wave;
- waves of 1: wave_size 1, the trainer feeds one engine per wave while the others serve;
- relay, waves of 1: relay true, wave_size 1, the trainer feeds engine 0, which relays to one engine per wave;
- relay, unbounded: relay true, wave_size 0, every holder relays to one engine per wave (the holders double).

A mode whose delivery plan (`waves.plan_waves`) equals an earlier mode's for that N is not run again (for N=1
every mode is one engine fed by the trainer). Reported per configuration, medians over the measured versions:
the seconds from the sync's start until the whole fleet serves the version (the last engine's row in the
trainer's `SyncMetrics.fleet`), `FleetDriver.sync`'s own wall time, the end of each wave (the trainer records
every engine of a wave as the wave ends: the first wave's end is when the first engines serve), and the
trainer's bytes per version as a multiple of the model. The bench exits non-zero, after
printing the table, unless every engine committed every measured version exactly, as planned.

Machine caveat: the trainer and the N engines share this machine's cores with each other (and here with other
users' jobs): a transfer over loopback costs both ends CPU, so engines that receive at once compete for it.

    PYTHONPATH=. python bench/bench_fleet.py                          # 1, 2, 4 engines; 32 MiB; 3 measured
    PYTHONPATH=. python bench/bench_fleet.py --engines 2,4 --mb 64 --versions 5 --bucket-mb 16
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from typing import Any, Iterable

import torch

from bench.bench_sync import load_average, machine_description
from megatron_sync.convert import get_family, keep_together_of
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.fleet.roster import EngineRecord, EngineState
from megatron_sync.fleet.waves import TRAINER, Delivery, plan_waves
from megatron_sync.core.meta import TensorMeta
from megatron_sync.core.metrics import align
from tests.support.dist import free_port
from tests.support.fakes import FakeEngine, FakeStream, make_tensor, shard_rule
from tests.support.fleet_fakes import drain

FAMILY = "deepseek_v3"  # the names below are its MLP weights; the fleet needs a family for keep-together
TENSOR_MIB = 4
MODES: dict[str, dict] = {  # mode -> the fleet settings both the trainer and every engine run with
    "all at once": {"wave_size": 0, "relay": False},
    "waves of 1": {"wave_size": 1, "relay": False},
    "relay, waves of 1": {"wave_size": 1, "relay": True},
    "relay, unbounded": {"wave_size": 0, "relay": True},
}
SESSION_TIMEOUT_S = 120.0  # weight_sync.timeout_s: the trainer's wait for its engines at start-up, every collective
RUN_TIMEOUT_S = 600.0  # one configuration, start-up included
EXIT_TIMEOUT_S = 60.0  # the engines' exits once the trainer closed the fleet
JOIN_S = 10.0


def model_metas(mib: int) -> list[TensorMeta]:
    """Return a float32 model of `mib` MiB in tensors of 4 MiB (DeepSeek MLP down projections)."""
    if mib <= 0 or mib % TENSOR_MIB:
        raise ValueError(f"--mb {mib}: use a positive multiple of {TENSOR_MIB} (the model is made of "
                         f"{TENSOR_MIB} MiB tensors)")
    rows = TENSOR_MIB * 2**20 // (4 * 1024)
    return [TensorMeta(f"model.layers.{i}.mlp.down_proj.weight", (rows, 1024), torch.float32)
            for i in range(mib // TENSOR_MIB)]


def fleet_config(port: int, engines: int, mode: str, bucket_mb: float) -> WeightSyncConfig:
    """Return the settings of one configuration (the trainer's; an engine adds its engine_id)."""
    return WeightSyncConfig(fleet=True, num_inference_ranks=engines, engine_tp_size=1, family=FAMILY,
                            master_port=port, timeout_s=SESSION_TIMEOUT_S, bucket_size_mb=bucket_mb, checksum="xxh3",
                            dtype="float32", **MODES[mode])


def planned(engines: int, mode: str) -> list[list[Delivery]]:
    """Return the waves the driver will plan for `engines` engines of one layout, none holding the version."""
    records = [EngineRecord(e, 0, EngineState.SERVING, layout="one layout") for e in range(engines)]
    return plan_waves(records, **MODES[mode])


class PreparedStream(FakeStream):
    """The seeded stream of one stage, each version's tensors made by `prepare` before its sync is timed."""

    def prepare(self, version: int) -> None:
        self.version = version
        self._tensors = {m.name: make_tensor(m, version) for m in self.metadata()}

    def walk(self, into=None, record=None):
        """Yield the prepared tensors; where `into` offers a slot, the tensor is written there and the slot yielded."""
        for meta in self.metadata():
            tensor = self._tensors[meta.name]
            slot = into(meta.name) if into is not None else None
            if slot is not None:
                slot.copy_(tensor)
                tensor = slot
            yield meta.name, tensor


class VerifyingEngine(FakeEngine):
    """A fake engine of one rank that compares each commit bit for bit with its version's tensors (made before
    it joined) and reports ("commit", engine, version, exact, time)."""

    def __init__(self, metas: list[TensorMeta], engine_id: int, versions: Iterable[int], reports: Any) -> None:
        super().__init__(metas, 0, 1)
        self.engine_id, self.reports = engine_id, reports
        self.reference = {v: {m.name: _bytes(shard_rule(m, make_tensor(m, v), 0, 1)) for m in metas}
                          for v in versions}

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        super().load_shards(shards, version)
        reference = self.reference.get(version, {})
        exact = bool(reference) and all(torch.equal(_bytes(shards[name]), want) for name, want in reference.items())
        self.reports.put(("commit", self.engine_id, version, exact, time.time()))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def trainer_main(config: WeightSyncConfig, mib: int, versions: list[int], reports: Any) -> None:
    """One trainer rank hosting the session: link the initial fleet, sync every version, stop the engines."""
    from megatron_sync.fleet.trainer import FleetDriver
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.transports.broadcast import BroadcastTransport
    from megatron_sync.session.rendezvous import Identity, expectations
    from megatron_sync.session.session import SyncSession

    metas = model_metas(mib)
    identity = Identity(job="trainer-bench", role="trainer", member=0,
                        expects=expectations(config, trainer_stages=1, backend="gloo",
                                             shares=BroadcastTransport.shares))
    session = SyncSession.host("127.0.0.1", config.master_port, identity, members={"trainer": 1},
                               timeout_s=config.timeout_s, engine_ranks=config.engine_tp_size)
    stream = PreparedStream(0, metas)
    driver = None
    try:
        session.wait_ready()
        driver = FleetDriver(config, ParallelLayout(), session=session, transport_cls=BroadcastTransport,
                             stream=stream, keep_together=keep_together_of(get_family(FAMILY), [m.name for m in metas]),
                             gather=lambda value: [value])
        driver.start()  # waits up to timeout_s for the initial fleet
        if len(driver.links) < config.num_engines:
            raise RuntimeError(f"only engines {sorted(driver.links)} of {config.num_engines} were linked within "
                               f"{config.timeout_s:g}s")
        for version in versions:
            stream.prepare(version)
            started = time.perf_counter()
            metrics = driver.sync(version)
            reports.put(("synced", version, metrics.fleet, time.perf_counter() - started))
    except BaseException as e:  # noqa: BLE001 — the bench reads it
        reports.put(("trainer-error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        if driver is not None:
            driver.close()
        session.close()
        reports.put(("trainer-exit",))


def engine_main(config: WeightSyncConfig, mib: int, engine_id: int, versions: list[int], reports: Any) -> None:
    """One engine job of one rank: serve until the trainer says "stop"; report every commit and how it left."""
    from megatron_sync.drivers.sync import InferenceWeightSync

    engine = VerifyingEngine(model_metas(mib), engine_id, versions, reports)
    isync = None
    try:
        isync = InferenceWeightSync(config.replace(engine_id=engine_id), engine, num_trainer_stages=1,
                                    inference_rank=0, job_id=f"engine{engine_id}-{uuid.uuid4().hex[:6]}")
        isync.serve()
        reports.put(("engine-exit", engine_id, engine.version, "stopped"))
    except BaseException as e:  # noqa: BLE001 — the bench reads it
        reports.put(("engine-exit", engine_id, engine.version, f"{type(e).__name__}: {e}"))
    finally:
        if isync is not None:
            isync.close()


def run_fleet(engines: int, mode: str, *, mib: int, versions: list[int], bucket_mb: float) -> list[tuple]:
    """Run one trainer and `engines` engine processes through `versions`; return every report, in order."""
    ctx = multiprocessing.get_context("spawn")
    config = fleet_config(free_port(), engines, mode, bucket_mb)
    reports = ctx.Queue()
    procs = [ctx.Process(target=trainer_main, args=(config, mib, versions, reports), daemon=True)]
    procs += [ctx.Process(target=engine_main, args=(config, mib, e, versions, reports), daemon=True)
              for e in range(engines)]
    try:
        for proc in procs:
            proc.start()
        seen = drain(reports, lambda r: r[0] == "trainer-exit", timeout=RUN_TIMEOUT_S)
        for engine in range(engines):
            if not any(r[0] == "engine-exit" and r[1] == engine for r in seen):
                seen += drain(reports, lambda r, e=engine: r[0] == "engine-exit" and r[1] == e,
                              timeout=EXIT_TIMEOUT_S)
        return seen
    finally:
        for proc in (p for p in procs if p.pid is not None):  # started
            proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_S)


def summarize(engines: int, mode: str, seen: list[tuple], measured: list[int], model_bytes: int) -> dict:
    """Return the medians of one configuration over the `measured` versions, and what was wrong with it."""
    synced = {r[1]: r for r in seen if r[0] == "synced"}
    commits = {(r[1], r[2]): r[3] for r in seen if r[0] == "commit"}
    plan = planned(engines, mode)
    problems = [f"engine {r[1]} left: {r[3]}" for r in seen if r[0] == "engine-exit" and r[3] != "stopped"]
    points = []
    for version in measured:
        rows = [row for row in synced[version][2] if "outcome" in row]
        served = {row["engine"]: row["seconds"] for row in rows if row["outcome"] == "committed"}
        inexact = [e for e in range(engines) if commits.get((e, version)) is not True]
        if sorted(served) != list(range(engines)) or inexact:
            problems.append(f"version {version}: committed by engines {sorted(served)} (of {engines}); not exact "
                            f"or not reported by the engine: {inexact}")
        if deliveries(rows) != plan:
            problems.append(f"version {version}: delivered {format_plan(deliveries(rows))}, planned "
                            f"{format_plan(plan)}")
        ends: dict[int, float] = {}
        for row in rows:
            ends[row["wave"]] = max(ends.get(row["wave"], 0.0), row["seconds"])
        points.append({"fleet": max(served.values(), default=float("nan")), "sync": synced[version][3],
                       "bytes": sum(row["trainer_bytes"] for row in rows) / model_bytes,
                       "ends": [ends[w] for w in sorted(ends)]})
    waves = max(len(p["ends"]) for p in points)
    return {
        "engines": engines, "mode": mode, "plan": format_plan(plan), "problems": problems,
        "fleet": [p["fleet"] for p in points],
        **{key: statistics.median(p[key] for p in points) for key in ("sync", "bytes")},
        "ends": [statistics.median(p["ends"][w] for p in points if len(p["ends"]) > w) for w in range(waves)],
    }


def deliveries(rows: list[dict]) -> list[list[Delivery]]:
    """Return the waves a version was delivered in, from the trainer's rows of it."""
    waves: dict[int, list[Delivery]] = {}
    for row in rows:
        source = TRAINER if row["source"] == TRAINER else int(row["source"].removeprefix("engine "))
        waves.setdefault(row["wave"], []).append(Delivery(row["engine"], source))
    return [sorted(waves[w], key=lambda d: d.engine) for w in sorted(waves)]


def format_plan(waves: list[list[Delivery]]) -> str:
    """E.g. "[0<T] [1<0] [2<0 3<1]": per wave, engine < its source (T: the trainer)."""
    return " ".join("[" + " ".join(f"{d.engine}<{'T' if d.source == TRAINER else d.source}" for d in wave) + "]"
                    for wave in waves)


def format_rows(results: list[dict]) -> str:
    """One row per configuration: the fleet-wide time and its spread, sync(), bytes, wave ends, plan."""
    return align(
        ["engines", "mode", "fleet serves s", "(min-max)", "sync() s", "trainer bytes/model",
         "exact", "wave ends s", "plan (engine<source)"],
        [[str(r["engines"]), r["mode"], f"{statistics.median(r['fleet']):.3f}",
          f"({min(r['fleet']):.3f}-{max(r['fleet']):.3f})", f"{r['sync']:.3f}",
          f"{r['bytes']:.2f}", "NO" if r["problems"] else "yes", " ".join(f"{s:.3f}" for s in r["ends"]), r["plan"]]
         for r in results])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="1,2,4", help="fleet sizes, comma-separated")
    parser.add_argument("--mb", type=int, default=32, help="model size in MiB (float32, 4 MiB tensors)")
    parser.add_argument("--versions", type=int, default=3, help="measured syncs per configuration (after 1 warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=8.0)
    args = parser.parse_args(argv)
    metas = model_metas(args.mb)
    model_bytes = sum(m.nbytes for m in metas)
    versions = list(range(1, args.versions + 2))
    print(machine_description())
    print(f"model: {len(metas)} float32 tensors of {TENSOR_MIB} MiB = {model_bytes / 2**20:g} MiB; trainer (1 process) "
          f"-> N engines of TP=1 (1 process each), broadcast over loopback (gloo), bucket {args.bucket_mb:g} MiB, "
          f"checksum xxh3; {len(versions)} syncs per configuration (first = warm-up), medians of the other "
          f"{args.versions}")
    results = []
    for engines in (int(n) for n in args.engines.split(",")):
        plans: dict[str, str] = {}
        for mode in MODES:
            plan = format_plan(planned(engines, mode))
            if plan in plans:
                print(f"  {engines} engine(s), {mode}: the plan of {plans[plan]!r} ({plan}); not run again", flush=True)
                continue
            plans[plan] = mode
            start = time.monotonic()
            seen = run_fleet(engines, mode, mib=args.mb, versions=versions, bucket_mb=args.bucket_mb)
            results.append(summarize(engines, mode, seen, versions[1:], model_bytes))
            print(f"  {engines} engine(s), {mode}: fleet serves in {statistics.median(results[-1]['fleet']):.3f}s "
                  f"({time.monotonic() - start:.0f}s wall with start-up; load average {load_average()})", flush=True)
    print(format_rows(results))
    problems = [f"{r['engines']} engine(s), {r['mode']}: {p}" for r in results for p in r["problems"]]
    print("every engine committed every measured version exactly, as planned" if not problems else
          "FAILED:\n" + "\n".join(problems))
    print(f"load average at end: {load_average()}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
