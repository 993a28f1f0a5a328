"""The main job: a Megatron trainer and a 2-rank inference engine, launched as two torchrun jobs.

    python -m examples.demo --config configs/demo_qwen3_moe_ep2.yaml [--weight-sync-bucket-size-mb 1]

Starts the trainer job (`examples.train_tiny`) and the inference job
(`examples.serve_checked`) as separately launched torchrun jobs that meet only
at the weight-sync rendezvous, hosts the demo's own store through which the
trainer checks what the engines compute, waits for both with a time limit, and
exits non-zero if either fails (for example on a logits mismatch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from examples.job import harness_store, job_arg_parser, job_argv, load_job
from tests.support.dist import free_port


def torchrun(nprocs: int, module: str, argv: list[str]) -> list[str]:
    """Return the command that runs `module` under torchrun with `nprocs` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", module, *argv,
    ]


def run_jobs(argv: list[str], trainer_procs: int, inference_procs: int, time_limit_s: float,
             inference_extra: list[str] = ()) -> int:
    """Run both jobs to completion; return the first non-zero exit code (0 if both succeeded)."""
    # Megatron and torchrun warn about missing TE/Apex and CUDA on every rank; keep the demo readable.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    jobs = {
        "trainer": subprocess.Popen(torchrun(trainer_procs, "examples.train_tiny", argv),
                                    env=env, start_new_session=True),
        "inference": subprocess.Popen(torchrun(inference_procs, "examples.serve_checked", [*argv, *inference_extra]),
                                      env=env, start_new_session=True),
    }
    deadline = time.monotonic() + time_limit_s
    codes: dict[str, int] = {}
    try:
        while len(codes) < len(jobs):
            for name, proc in jobs.items():
                if name not in codes and proc.poll() is not None:
                    codes[name] = proc.returncode
                    if proc.returncode:
                        print(f"[demo] the {name} job failed (exit {proc.returncode})", flush=True)
            if time.monotonic() > deadline:
                print(f"[demo] time limit of {time_limit_s:g}s reached; stopping both jobs", flush=True)
                return 124
            time.sleep(0.2)
    finally:
        for proc in jobs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    return next((code for code in codes.values() if code), 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = job_arg_parser("megatron-sync demo: train on CPU, sync to a separately launched engine")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds before both jobs are stopped")
    parser.add_argument("--test-exit-during-version", type=int, default=0,
                        help="fault injection: inference rank 1 exits while receiving this version")
    args = parser.parse_args(argv)
    if args.weight_sync_master_port is None:
        args.weight_sync_master_port = free_port()
    job = load_job(args)  # validate before launching anything
    args.harness_port = free_port()
    store = harness_store(args.harness_port, host=True, timeout_s=job.weight_sync.timeout_s)  # noqa: F841 — serves until exit
    passthrough = job_argv(args)
    t, ws = job.trainer, job.weight_sync
    print(f"[demo] {job.model['family']}: trainer world {t.world_size} (tp={t.tp} pp={t.pp} vpp={t.vpp} "
          f"ep={t.ep} etp={t.etp}) -> {ws.num_engines} engine(s) of tp={ws.engine_tp_size}; "
          f"{job.train.steps} optimizer steps, bucket {ws.bucket_size_mb:g} MiB", flush=True)
    fault = ["--test-exit-during-version", str(args.test_exit_during_version)] if args.test_exit_during_version else []
    code = run_jobs(passthrough, t.world_size, ws.num_inference_ranks, args.time_limit, fault)
    print(f"[demo] {'ok' if code == 0 else f'FAILED (exit {code})'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
