"""The demo's inference job: `megatron_sync.drivers.serve` around reference engines, plus the demo's checks.

Run under torchrun (one process per inference rank), e.g.
    torchrun --nproc-per-node 2 -m examples.serve_checked --config configs/demo_qwen3_moe_ep2.yaml
The engines are built from the job YAML's tiny model; on the trainer's "verify"
message they post their logits, on "rollout" they generate while the next sync
arrives and post the responses with the versions each token came from. Both go
to the demo's own store (`--harness-port`), not through the library.
`--test-exit-during-version` makes one rank die mid-sync, `--test-hang-during-version`
makes it hang there (fault injection for the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future

import torch

from examples.job import JobConfig, deaf_to_stop_signals, harness_store, job_arg_parser, run_under_torchrun
from megatron_sync.drivers.serve import EngineRank, join, serve
from megatron_sync.drivers.sync import InferenceWeightSync
from megatron_sync.session.control import ControlMessage, ControlOp
from examples.tiny.faults import FaultyLayout


class _DiesMidSync:
    """Fault injection (for the test suite): the wrapped engine's process exits while staging `version`."""

    def __init__(self, engine, version: int):
        self._engine, self._version = engine, version

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def rank_layout(self):
        return FaultyLayout.wrap(self._engine.rank_layout(), self._before_write)

    def _before_write(self, n: int) -> None:
        if self._engine.version == self._version - 1 and n > 3:  # a few tensors into the sync
            print(f"[inference] fault injection: exiting while receiving version {self._version}", flush=True)
            os._exit(17)


class _HangsMidSync(_DiesMidSync):
    """Fault injection (for the test suite): the wrapped engine's rank hangs while staging `version`, deaf to
    SIGTERM (as a rank stuck in native code is)."""

    def _before_write(self, n: int) -> None:
        if self._engine.version == self._version - 1 and n > 3:
            print(f"[inference] fault injection: hanging while receiving version {self._version}", flush=True)
            deaf_to_stop_signals()
            time.sleep(3600)


class DemoChecks:
    """The demo's application messages: "verify" (post logits) and "rollout" (generate across a sync)."""

    def __init__(self, job: JobConfig, me: EngineRank, store) -> None:
        self.job, self.me, self.store = job, me, store

    def verify(self, isync: InferenceWeightSync, message: ControlMessage) -> None:
        version, engine = message.payload["version"], self.me.engine
        if engine.version != version:
            raise RuntimeError(f"engine {self.me.engine_index} is on version {engine.version}, expected {version}")
        logits = engine.logits(torch.tensor(message.payload["tokens"]))
        if self.me.tp_rank == 0:
            buffer = io.BytesIO()
            torch.save(logits, buffer)
            self.store.set(f"logits/{version}/{self.me.engine_index}", buffer.getvalue())
        self._dump(f"v{version}", f"engine{self.me.engine_index}_rank{self.me.tp_rank}.pt")

    def rollout(self, isync: InferenceWeightSync, message: ControlMessage) -> None:
        """Generate while the trainer's next sync arrives; the switch obeys inflight_policy."""
        receiving: list[Future] = []
        switch = self.job.verify.rollout_switch_step

        def take_in_the_next_sync(step: int) -> None:
            if step == switch:  # a step boundary mid-generation: the trainer's next sync starts now
                sync = isync.next_control(timeout_s=self.job.weight_sync.timeout_s)
                assert sync.op is ControlOp.SYNC, f"expected the next sync during a rollout, got {sync}"
                receiving.append(isync.apply_in_background(sync.version))
            elif step == switch + 1:  # make the switch land at a known boundary
                isync.server.wait_for_commit(self.me.engine.version + 1, timeout=self.job.weight_sync.timeout_s)

        payload = message.payload
        responses = isync.server.generate(payload["prompts"], payload["max_new_tokens"],
                                          before_step=take_in_the_next_sync)
        for future in receiving:
            future.result(timeout=self.job.weight_sync.timeout_s)
        if self.me.tp_rank == 0:
            report = [{"tokens": r.tokens, "finish_reason": r.finish_reason, "weight_versions": r.weight_versions,
                       "kv_versions": r.kv_versions, "off_policy_kv": r.off_policy_kv} for r in responses]
            self.store.set(f"rollout/{payload['version']}/{self.me.engine_index}", json.dumps(report).encode())

    def dump_survivor(self) -> None:
        self._dump("", f"survivor_engine{self.me.engine_index}_rank{self.me.tp_rank}.pt")

    def _dump(self, folder: str, name: str) -> None:
        """Write what the rank holds, whole or not at all: a SIGTERM arriving meanwhile (the demo stops a
        surviving job a few seconds after the other failed) waits until the file is in place."""
        if self.job.verify.dump_dir:
            path = os.path.join(self.job.verify.dump_dir, folder)
            os.makedirs(path, exist_ok=True)
            with _signals_deferred():
                torch.save({"version": self.me.engine.version, "shards": self.me.engine.snapshot()},
                           os.path.join(path, name + ".partial"))
                os.replace(os.path.join(path, name + ".partial"), os.path.join(path, name))


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGTERM / SIGINT that arrive in the block and raise them after it (main thread; elsewhere Python
    runs no signal handler anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:
            signal.raise_signal(sig)  # handled now, by the job's own handler


def run(job: JobConfig, args: argparse.Namespace) -> int:
    from examples.tiny.models import hf_config

    ws = job.weight_sync
    me = join(ws, hf_config(job.model_spec()))
    if args.test_exit_during_version and me.rank == args.test_exit_rank:
        me.engine = _DiesMidSync(me.engine, args.test_exit_during_version)
    if args.test_hang_during_version and me.rank == args.test_exit_rank:
        me.engine = _HangsMidSync(me.engine, args.test_hang_during_version)
    checks = DemoChecks(job, me, harness_store(args.harness_port, timeout_s=ws.timeout_s))
    # on_stop: every way out (stop, a failure, SIGTERM even while blocked) dumps what the rank holds
    # the trainer's stages are adopted at its rendezvous; disk_delta meets through files and is told them
    stages = job.trainer.pp if ws.transport == "disk_delta" else None
    return serve(me, ws, num_trainer_stages=stages, handlers={"verify": checks.verify, "rollout": checks.rollout},
                 on_stop=checks.dump_survivor)


def main(argv=None) -> int:
    parser = job_arg_parser("megatron-sync demo inference job (run under torchrun)")
    faults = parser.add_argument_group("fault injection (test suite)")
    faults.add_argument("--test-exit-during-version", type=int, default=0,
                        help="make one inference rank exit while it receives this version")
    faults.add_argument("--test-hang-during-version", type=int, default=0,
                        help="make one inference rank hang (deaf to SIGTERM) while it receives this version")
    faults.add_argument("--test-exit-rank", type=int, default=1, help="the inference rank that exits or hangs")
    args = parser.parse_args(argv)
    return run_under_torchrun("inference", args, lambda job: run(job, args))


if __name__ == "__main__":
    sys.exit(main())
