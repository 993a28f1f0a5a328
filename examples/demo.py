"""The main job: a Megatron trainer and a 2-rank inference engine, launched as two torchrun jobs.

    python -m examples.demo --config configs/demo_qwen3_moe_ep2.yaml [--weight-sync-bucket-size-mb 1]

Validates the whole job YAML, then starts the trainer job (`examples.train_tiny`)
and the inference job (`examples.serve_checked`) as separately launched torchrun
jobs that meet only at the weight-sync rendezvous (the YAML's
`weight_sync.master_address:master_port`, used as written), hosts the demo's
own store through which the trainer checks what the engines compute, and
supervises both: when one job fails the other is stopped within seconds, and
SIGTERM / SIGINT stop the trainer first (it tells the engines to stop), then
the engines, then anything left of either job. Exits non-zero if either fails
(for example on a logits mismatch).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from examples.job import harness_store, job_arg_parser, job_argv, load_job
from megatron_sync.core.lifecycle import Terminated, stop_on_signals


def free_port() -> int:
    """Return a loopback port free a moment ago (the demo's own harness store; one run, nothing races it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(nprocs: int, module: str, argv: list[str]) -> list[str]:
    """Return the command that runs `module` under torchrun with `nprocs` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *argv,
    ]


STOP_GRACE_S = {"trainer": 15.0, "inference": 10.0}
"""How long a job may take to stop after SIGTERM before everything left of it is killed."""
SELF_STOP_S = 3.0
"""How long the surviving job gets, once the other failed, to notice and stop by itself (saying why in its
own words, e.g. an idle engine whose trainer is gone) before the demo sends SIGTERM."""
OTHER_JOB_GRACE_S = 10.0
"""How long the surviving job may then take to stop after SIGTERM."""


def run_jobs(argv: list[str], trainer_procs: int, inference_procs: int, time_limit_s: float,
             inference_extra: list[str] = (), trainer_extra: list[str] = ()) -> int:
    """Run both jobs under supervision; return 0 if both succeeded, else the first failure's exit code."""
    # Megatron and torchrun warn about missing TE/Apex and CUDA on every rank; keep the demo readable.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    jobs = {
        "trainer": subprocess.Popen(torchrun(trainer_procs, "examples.train_tiny", [*argv, *trainer_extra]),
                                    env=env, start_new_session=True),
        "inference": subprocess.Popen(torchrun(inference_procs, "examples.serve_checked", [*argv, *inference_extra]),
                                      env=env, start_new_session=True),
    }
    print(f"[demo] trainer job pid {jobs['trainer'].pid}, inference job pid {jobs['inference'].pid}", flush=True)
    try:
        with stop_on_signals():
            return _supervise(jobs, time_limit_s)
    except Terminated as e:
        print(f"[demo] {e}: stopping the trainer (it tells the engines to stop), then the engines", flush=True)
        for name in ("trainer", "inference"):
            stop_job(name, jobs[name], STOP_GRACE_S[name])
        return e.exit_code
    finally:
        for name, proc in jobs.items():
            stop_job(name, proc, 0.0)  # nothing of either job outlives the demo


def _supervise(jobs: dict[str, subprocess.Popen], time_limit_s: float) -> int:
    """Wait for both jobs; stop the survivor when one fails or the limit passes; return the exit code."""
    deadline = time.monotonic() + time_limit_s
    codes: dict[str, int] = {}
    while len(codes) < len(jobs):
        for name, proc in jobs.items():
            if name in codes or proc.poll() is None:
                continue
            codes[name] = proc.returncode
            if proc.returncode:
                others = [other for other in jobs if other not in codes]
                print(f"[demo] the {name} job failed (exit {proc.returncode})"
                      + (f"; stopping the {others[0]} job" if others else ""), flush=True)
                for other in others:
                    try:
                        jobs[other].wait(SELF_STOP_S)
                    except subprocess.TimeoutExpired:
                        pass
                    stop_job(other, jobs[other], OTHER_JOB_GRACE_S)
                    codes[other] = jobs[other].returncode
                return proc.returncode
        if time.monotonic() > deadline:
            print(f"[demo] time limit of {time_limit_s:g}s reached; stopping both jobs", flush=True)
            for name in jobs:
                stop_job(name, jobs[name], OTHER_JOB_GRACE_S)
            return 124
        time.sleep(0.2)
    return 0


def stop_job(name: str, proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the job's torchrun (it forwards the signal to its workers), then after `grace_s` SIGKILL
    torchrun and every process it started, including workers it left in their own sessions."""
    family = descendants(proc.pid)
    if proc.poll() is None and grace_s > 0:
        _signal(proc.pid, signal.SIGTERM, group=True)
        frozen = stopped([proc.pid, *family])
        if frozen:  # a stopped process never acts on SIGTERM: its grace would only be waited out
            print(f"[demo] the {name} job's process {', '.join(map(str, frozen))} is stopped (e.g. SIGSTOP) and "
                  "cannot act on SIGTERM; killing it now, the rest of the job gets its grace", flush=True)
            for pid in frozen:
                _signal(pid, signal.SIGKILL, group=False)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"[demo] the {name} job did not stop within {grace_s:g}s of SIGTERM; killing it", flush=True)
    for pid in [proc.pid, *family, *descendants(proc.pid)]:
        _signal(pid, signal.SIGKILL, group=(pid == proc.pid))
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Return the pids of every living process below `pid` (from /proc; workers may sit in other sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stopped(pids: list[int]) -> list[int]:
    """Return those of `pids` that are stopped (state T: SIGSTOP, or t: stopped by a tracer), from /proc."""
    return [pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] in ("T", "t")]


def _stat(pid: int) -> list[str] | None:
    """Return the fields of /proc/<pid>/stat after the command name (state, parent pid, ...); None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _signal(pid: int, sig: int, *, group: bool) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def port_in_use(port: int) -> str | None:
    """Return why `port` cannot be bound on this machine, or None when it is free."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = job_arg_parser("megatron-sync demo: train on CPU, sync to a separately launched engine")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds before both jobs are stopped")
    parser.add_argument("--test-exit-during-version", type=int, default=0,
                        help="fault injection: inference rank 1 exits while receiving this version")
    parser.add_argument("--test-hang-during-version", type=int, default=0,
                        help="fault injection: inference rank 1 hangs while receiving this version")
    parser.add_argument("--test-pause-after-version", type=int, default=0,
                        help="fault injection: the trainer idles for a long while after syncing this version")
    parser.add_argument("--test-fault-during-version", nargs=2, action="append", default=[],
                        metavar=("FAULT", "VERSION"),
                        help="fault injection: the trainer's leader stops (stop) or SIGTERMs its torchrun (sigterm, "
                             "sigterm-deaf) while sending VERSION")
    args = parser.parse_args(argv)
    try:
        job = load_job(args)  # the whole file, before launching anything
    except ValueError as e:
        print(f"[demo] {e}", flush=True)
        return 2
    ws = job.weight_sync
    busy = port_in_use(ws.master_port)
    if busy:
        print(f"[demo] weight_sync.master_port {ws.master_port} is in use on this machine ({busy}); set a free "
              "one in the YAML or pass --weight-sync-master-port", flush=True)
        return 2
    args.harness_port = free_port()
    store = harness_store(args.harness_port, host=True, timeout_s=job.weight_sync.timeout_s)  # noqa: F841 — serves until exit
    passthrough = job_argv(args)
    t = job.trainer
    print(f"[demo] {job.model['family']}: trainer world {t.world_size} (tp={t.tp} pp={t.pp} vpp={t.vpp} "
          f"ep={t.ep} etp={t.etp}) -> {ws.num_engines} engine(s) of tp={ws.engine_tp_size}; "
          f"{job.train.steps} optimizer steps, bucket {ws.bucket_size_mb:g} MiB", flush=True)
    print(f"[demo] rendezvous at {ws.master_address}:{ws.master_port} (weight_sync.master_address/master_port)",
          flush=True)
    engine_faults = [*(["--test-exit-during-version", str(args.test_exit_during_version)]
                       if args.test_exit_during_version else []),
                     *(["--test-hang-during-version", str(args.test_hang_during_version)]
                       if args.test_hang_during_version else [])]
    trainer_faults = [*(["--test-pause-after-version", str(args.test_pause_after_version)]
                        if args.test_pause_after_version else []),
                      *[arg for fault in args.test_fault_during_version
                        for arg in ("--test-fault-during-version", *fault)]]
    code = run_jobs(passthrough, t.world_size, ws.num_inference_ranks, args.time_limit, engine_faults, trainer_faults)
    print(f"[demo] {'ok' if code == 0 else f'FAILED (exit {code})'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
