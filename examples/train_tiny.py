"""The demo's trainer job: train a tiny Megatron model on CPU and sync it after optimizer steps.

Run under torchrun (one process per trainer rank), e.g. by launch/train.sh (its default entry point)
    NPROC=2 launch/train.sh --config configs/demo_qwen3_moe_ep2.yaml
with the demo's inference job (`examples.serve_checked`) started separately against the same
`weight_sync.master_address:master_port`. Besides syncing, it checks every version against the
engines (logits, generation spans) through the demo's own store. The tiny model is built on CPU with
the test support's megatron-core shims; a real job builds its own model and keeps only the callback.
"""

from __future__ import annotations

import io
import json
import math
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

from examples.job import JobConfig, deaf_to_stop_signals, harness_store, job_arg_parser, run_under_torchrun
from megatron_sync.drivers.callback import WeightSyncCallback
from megatron_sync.core.metrics import format_table
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.drivers.sync import TrainerWeightSync


def build_trainer(job: JobConfig):
    """Return (chunks, layout, HF config) for this rank: a seeded tiny model under the job's layout."""
    from examples.tiny import models
    from examples.tiny.megatron import init_megatron

    t = job.trainer
    minutes = max(2, math.ceil(4 * job.weight_sync.timeout_s / 60))  # Megatron's groups: bounded too
    init_megatron(tp=t.tp, pp=t.pp, vpp=t.vpp, ep=t.ep, etp=t.etp, seed=job.train.seed, timeout_minutes=minutes)
    spec = job.model_spec()
    chunks = models.build_model_chunks(spec, vpp=t.vpp)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=job.train.seed), spec)
    return chunks, ParallelLayout.from_megatron(), models.hf_config(spec)


def batch(job: JobConfig, step: int, vocab_size: int) -> torch.Tensor:
    """Return the token batch of `step` (seeded, identical on every rank)."""
    gen = torch.Generator().manual_seed(job.train.seed * 1000 + step)
    return torch.randint(0, vocab_size, (job.train.batch_size, job.train.seq_len), generator=gen)


def eval_tokens(job: JobConfig, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(job.train.seed + 17)
    return torch.randint(0, vocab_size, (job.verify.eval_batch, job.verify.eval_seq_len), generator=gen)


class Verifier:
    """After each sync: engine logits must equal the trainer's; optionally dump what was sent."""

    def __init__(self, job: JobConfig, sync: TrainerWeightSync, chunks: list, store):
        self.job, self.sync, self.chunks, self.store = job, sync, chunks, store
        self.vocab_size = job.model_spec().vocab_size
        self.failures: list[str] = []
        self.rows = []

    def after_sync(self, version: int, metrics) -> None:
        from examples.tiny.models import megatron_logits

        tokens = eval_tokens(self.job, self.vocab_size)
        logits = megatron_logits(self.chunks, tokens) if self.job.verify.logits else None
        self._dump_sent(version)
        if not self.sync.is_leader:
            return
        self.rows.append(metrics)
        self.rows.extend(self.sync.receiver_metrics(version))  # raises if the engines aborted the version
        self.sync.send_app_message({"name": "verify", "version": version, "tokens": tokens.tolist()})
        if logits is None:
            return
        for engine in range(self.job.weight_sync.num_engines):
            got = torch.load(io.BytesIO(self.store.get(f"logits/{version}/{engine}")))
            diff = float((got - logits).abs().max())
            ok = diff <= self.job.verify.logits_atol
            print(f"[trainer] version {version}: engine {engine} logits max |diff| = {diff:.3e} "
                  f"({'ok' if ok else 'MISMATCH'}, atol {self.job.verify.logits_atol:g})", flush=True)
            if not ok:
                self.failures.append(f"version {version} engine {engine}: logits differ by {diff:.3e}")

    def start_rollout(self, version: int) -> None:
        """Ask the engines to generate on `version` while the next sync arrives (leader only)."""
        if self.job.verify.rollout_tokens and self.sync.is_leader:
            gen = torch.Generator().manual_seed(version)
            prompts = torch.randint(0, self.vocab_size, (2, 6), generator=gen).tolist()
            self.sync.send_app_message({"name": "rollout", "version": version, "prompts": prompts,
                                        "max_new_tokens": self.job.verify.rollout_tokens})

    def check_rollout(self, version: int) -> None:
        """Check the versions recorded by the rollout that started on `version` (leader only)."""
        if not self.job.verify.rollout_tokens or not self.sync.is_leader:
            return
        policy, switch = self.job.weight_sync.inflight_policy, self.job.verify.rollout_switch_step + 1
        for engine in range(self.job.weight_sync.num_engines):
            for index, response in enumerate(json.loads(self.store.get(f"rollout/{version}/{engine}"))):
                spans = [tuple(s) for s in response["weight_versions"]]
                if policy == "abort":
                    want = [(version, 0, switch)]
                    ok = spans == want and response["finish_reason"] == "aborted"
                else:
                    want = [(version, 0, switch), (version + 1, switch, self.job.verify.rollout_tokens)]
                    ok = spans == want and response["off_policy_kv"] == (policy == "keep")
                print(f"[trainer] rollout started on version {version} (policy {policy}): engine {engine} request {index} "
                      f"weight_versions {spans}, kv_versions {[tuple(s) for s in response['kv_versions']]}, "
                      f"finish {response['finish_reason']} ({'ok' if ok else 'UNEXPECTED'})", flush=True)
                if not ok:
                    self.failures.append(f"rollout on version {version} engine {engine}: spans {spans}, want {want}")

    def _dump_sent(self, version: int) -> None:
        if not self.job.verify.dump_dir:
            return
        sent = self.sync.sender.sent_tensors()
        if sent is None:
            raise ValueError(f"verify.dump_dir: transport {self.job.weight_sync.transport!r} keeps no copy of what "
                             "it sent; unset verify.dump_dir or use transport broadcast, p2p or ipc")
        if not sent:
            return
        folder = os.path.join(self.job.verify.dump_dir, f"v{version}")
        os.makedirs(folder, exist_ok=True)
        torch.save({name: t.clone() for name, t in sent.items()},
                   os.path.join(folder, f"sent_stage{self.sync.stream.stage}_rank{dist.get_rank()}.pt"))


def pause_after(pause_version: int, version: int) -> None:
    """Fault injection (for the test suite): idle (between syncs, on every rank) once `version` is synced."""
    if pause_version and version == pause_version:
        print(f"[trainer] fault injection: idling after version {version}", flush=True)
        time.sleep(PAUSE_S)


PAUSE_S = 600.0


def fault_during(sync: TrainerWeightSync, version: int, fault: str) -> None:
    """Fault injection (for the test suite): the leader injects `fault` (a key of FAULTS) into the sync of `version`."""
    if not version or not sync.is_leader:
        return
    words, inject, at_transfer = FAULTS[fault]
    if at_transfer:  # once the engines took part in the first transfer (a bucket broadcast, a P2P message)
        transport = sync.transport
        owner, name = (transport, "send_bucket") if hasattr(transport, "send_bucket") else (transport.mover, "write")
    else:  # before the sync's first byte
        owner, name = sync.sender, "sync"
    send, done = getattr(owner, name), []

    def send_then_fault(*args):
        if not at_transfer and sync.version + 1 == version and not done:
            done.append(True)
            print(f"[trainer] fault injection: {words} while sending version {version}", flush=True)
            inject()
        sent = send(*args)
        if at_transfer and sync.version + 1 == version and not done:  # sync.version: the last version synced
            done.append(True)
            if sent is not None:  # every engine rank received this bucket (this P2P message): they are in the sync
                sent.wait(*(() if hasattr(transport, "send_bucket") else (sync.config.timeout_s,)))
            print(f"[trainer] fault injection: {words} while sending version {version}", flush=True)
            inject()
        return sent

    setattr(owner, name, send_then_fault)


def _sigterm_while_deaf() -> None:
    """SIGTERM to the trainer job while this rank is deaf to it, as a rank blocked in native code is."""
    deaf_to_stop_signals()
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(PAUSE_S)


def _sigterm_mid_sync() -> None:
    """SIGTERM to the trainer job, then this rank stays inside the sync until torchrun's forwarded signal
    unwinds it (`lifecycle.Terminated`): the version being sent cannot commit before the signal lands."""
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(PAUSE_S)


def _disk_full() -> None:
    """Files this process writes can grow no further (the kernel refuses as it does on a full disk)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


FAULTS = {  # name: (what it does, in words; how; at the first transfer (else before the sync starts))
    "stop": ("stopping (SIGSTOP)", lambda: os.kill(os.getpid(), signal.SIGSTOP), True),
    "sigterm": ("SIGTERM to the trainer job", _sigterm_mid_sync, True),
    "sigterm-deaf": ("SIGTERM to the trainer job, deaf to it", _sigterm_while_deaf, True),
    "disk-full": ("the disk is full (RLIMIT_FSIZE)", _disk_full, False),
}


def run(job: JobConfig, harness_port: int, pause_version: int = 0, faults: dict[str, int] | None = None) -> int:
    """Train for `job.train.steps` optimizer updates, syncing per the config; return an exit code."""
    from examples.tiny.train import make_optimizer, train_step, wrap_in_ddp

    if not job.weight_sync.enabled:
        raise ValueError("this job checks every sync against the engines; set weight_sync.enabled: true")
    chunks, layout, hf_config = build_trainer(job)
    model = wrap_in_ddp(chunks)  # what a Megatron job hands the library: DDP-wrapped chunks
    optimizer = make_optimizer(model, job.train.lr)
    # Collective; with sync_on_start (the demo's default) the engines get the initial weights as version 1.
    # Leaving the block, also on SIGTERM / SIGINT, tells the engines to stop.
    # The dumps are what was sent: a transport that keeps no copy (p2p) keeps one when asked. Each sync's
    # figures go to TensorBoard on rank 0 when the job names a folder (train.tensorboard_dir).
    writer = tensorboard_writer(job.train.tensorboard_dir) if dist.get_rank() == 0 else None
    with WeightSyncCallback.from_config(job.weight_sync, model, hf_config=hf_config, layout=layout,
                                        keep_sent=bool(job.verify.dump_dir), writer=writer) as callback:
        sync = callback.syncer
        for fault, version in (faults or {}).items():
            fault_during(sync, version, fault)
        verifier = Verifier(job, sync, chunks, harness_store(harness_port, timeout_s=job.weight_sync.timeout_s))
        if callback.initial_metrics is not None:
            verifier.after_sync(sync.version, callback.initial_metrics)
            pause_after(pause_version, sync.version)
        for step in range(job.train.steps):
            if job.weight_sync.every_n_steps == 1 and sync.version:
                verifier.start_rollout(sync.version)  # generation in flight when the next sync arrives
            loss = train_step(model, optimizer, batch(job, step, verifier.vocab_size), layout)
            if sync.is_leader:
                print(f"[trainer] step {step + 1}: loss {loss:.4f}", flush=True)
            metrics = callback.after_optimizer_step()
            if metrics is not None:
                verifier.after_sync(sync.version, metrics)
                verifier.check_rollout(sync.version - 1)
                pause_after(pause_version, sync.version)
    failures = [verifier.failures]
    dist.broadcast_object_list(failures, src=0)
    if dist.get_rank() == 0:
        print("\n" + format_table(verifier.rows), flush=True)
        print(f"\n[trainer] {sync.version} versions synced; "
              f"{'all checks passed' if not failures[0] else 'FAILED: ' + '; '.join(failures[0])}", flush=True)
    return 1 if failures[0] else 0


def tensorboard_writer(folder: str | None):
    """Return a TensorBoard writer into `folder` (None: no writer)."""
    if not folder:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=folder)


def main(argv=None) -> int:
    parser = job_arg_parser("megatron-sync demo trainer job (run under torchrun)")
    parser.add_argument("--test-pause-after-version", type=int, default=0,
                        help="fault injection (test suite): idle for a long while after syncing this version")
    parser.add_argument("--test-fault-during-version", nargs=2, action="append", default=[],
                        metavar=("FAULT", "VERSION"), help=f"fault injection (test suite): one of {sorted(FAULTS)}, in the "
                                                           "leader while it sends VERSION")
    args = parser.parse_args(argv)
    faults = {fault: int(version) for fault, version in args.test_fault_during_version}
    return run_under_torchrun("trainer", args, lambda job: run(job, args.harness_port, args.test_pause_after_version,
                                                              faults))


if __name__ == "__main__":
    sys.exit(main())
