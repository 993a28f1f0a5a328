"""Faults an operator found by trying them on the real launched jobs: each ends within a stated bound, named.

Each test launches the real jobs (the demo's two torchrun jobs, or `launch/train.sh` +
`launch/serve.sh`), injects one fault, and checks what an operator would: the message names
the fault and the peer, the time it takes is bounded by the configured `timeout_s` plus a
stated margin (a bound that says "does not hang", generous for a loaded 2-core machine, not a
performance figure), the engines hold exactly the previous version, and no process is left.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys

import pytest
import yaml

from tests.support.dist import free_port
from tests.support.launched import within_bound
from tests.support.timing import bounded
from tests.test_lifecycle import (_assert_engines_hold, _demo, _demo_job, _engine_model, _launch_pair, _pair_ends,
                                  assert_nothing_left)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FAULT_TIMEOUT_S = 10.0  # weight_sync.timeout_s of these runs
MARGIN_S = 10.0  # start-up of a probe, process exit, a loaded machine: what a bound adds to timeout_s


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_a_trainer_stopped_mid_sync_ends_the_engines_within_timeout_s_naming_it(tmp_path, transport):
    """SIGSTOP, not death: the trainer's sockets stay open and its store accepts connections but never
    answers. Every wait of the engines (the transfer, the store's control channel) ends within timeout_s,
    the engines say the trainer is stopped or hung, keep version 1 and exit 1.

    The leader stops once an engine rank took part in the first transfer of version 2; another engine
    rank may not have read the "sync 2" message yet (P2P), and it reports from its control channel. The
    first rank to exit makes torchrun stop its sibling, which may then say so instead."""
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml")
    demo = _demo(path, "--test-fault-during-version", "stop", "2", "--weight-sync-transport", transport,
                 "--weight-sync-timeout-s", str(FAULT_TIMEOUT_S))
    where = re.escape(f"127.0.0.1:{job['weight_sync']['master_port']}")
    # A rank whose transfer wait ended probes the host (within 2s) and names the peer it waited for; one whose
    # wait was on the store itself (a P2P notice), or whose peer engine rank exited first, finds the host
    # already known silent: each says the trainer is stopped and the engine keeps version 1.
    stopped = (r"its rendezvous at " + where + r" accepts connections but does not answer{within}: the trainer is "
               r"stopped \(e\.g\. SIGSTOP\) or hung; the engine stays on version 1")
    mid_sync = r"sync of version 2 failed: .*" + stopped.format(within="( within 2s)?")
    mid_sync_named = r"sync of version 2 failed: .*from (trainer )?rank 0.*" + stopped.format(within=" within 2s")
    reading_control = (r"the trainer stopped answering while this engine was idle: its rendezvous at " + where
                       + r" accepts connections but has not answered for 10s \(the trainer is stopped, e\.g\. "
                       r"SIGSTOP, or hung\); no sync was running, the engine holds version 1")
    stopped_by_sibling = r"stopped by SIGTERM.*; the engine stays on version 1"
    try:
        at = demo.when(r"\[trainer\] fault injection: stopping \(SIGSTOP\) while sending version 2")
        # timeout_s for the wait that noticed, DIAGNOSE_S (2 s) to probe the trainer's host, then the exit
        demo.when(rf"\[inference rank \d\] ({mid_sync}|{reading_control})",
                  by=within_bound(at, FAULT_TIMEOUT_S + MARGIN_S))
        demo.when(r"\[demo\] the inference job failed \(exit 1\)", by=within_bound(at, FAULT_TIMEOUT_S + 2 * MARGIN_S))
        code, _ = demo.wait(60)
    finally:
        demo.kill()
    out = demo.output
    assert code == 1, out[-5000:]
    # One rank was receiving version 2. Over P2P the other may have been idle: its control wait can end (10 s)
    # before the receiving rank's transfer wait plus the 2 s probe, and torchrun then stops the receiving rank
    # first (it says so: stopped by SIGTERM, on version 1). Over broadcast both ranks were receiving.
    receiving = mid_sync_named if transport == "broadcast" else f"({mid_sync}|{stopped_by_sibling})"
    assert re.search(rf"\[inference rank \d\] {receiving}", out), out[-5000:]
    for rank in (0, 1):
        assert re.search(rf"\[inference rank {rank}\] ({mid_sync}|{reading_control}|{stopped_by_sibling})", out), \
            out[-5000:]
    _assert_engines_hold(tmp_path, job, 1)
    assert_nothing_left(path)


def test_a_megatron_model_that_differs_from_its_hf_config_is_refused_before_the_first_sync(tmp_path):
    """The trainer's Megatron model was built with rotary base 1e6; the HF config it sends under (and the
    engine's) says rope_theta 1e4. Every tensor shape agrees; the trainer refuses at start-up naming the
    value, both sides of it and the option to set, and the engine, told at once, keeps version 0."""
    model_dir, engine_config = _engine_model(tmp_path)
    train, serve, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                        weight_sync={}, trainer_args=("--rotary-base", "1e6"))
    # the trainer keeps its rendezvous open until the engine, still starting when it failed, was told; then leaves
    train_code, serve_code = _pair_ends(
        train, serve, serve, r"\[inference rank 0\] could not join the trainer: .* refused this rank: session "
                             r"'[\w.-]+' has failed: the trainer failed while starting: ", exit_within=(MARGIN_S, 60.0))
    words = ("rotary base: the Megatron model has rotary_base=1000000.0, the HF config "
             "rope_parameters.rope_theta=10000.0 (set rotary_base (--rotary-base) to match, or send under the HF "
             "config of the model being trained: weight_sync.hf_config_path)")
    assert train_code != 0 and words in train.output, train.output[-4000:]
    assert "the Megatron model being trained and the HF config its weights are sent under define different models" \
        in train.output
    assert serve_code == 1 and words in serve.output, serve.output[-4000:]
    assert "the engine stays on version 0" in serve.output
    assert "synced version" not in train.output
    assert_nothing_left(config)


def test_a_setting_only_its_transport_uses_is_compared_at_the_rendezvous(tmp_path):
    """P2P: the trainer moves bytes with torch, the inference job was started with Mooncake. Both meet at
    the rendezvous, which refuses the inference job naming the setting, both values and where to set it,
    before any transfer could time out."""
    model_dir, engine_config = _engine_model(tmp_path)
    train, serve, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                        weight_sync={"transport": "p2p", "timeout_s": FAULT_TIMEOUT_S},
                                        engine_args=("--weight-sync-p2p-backend", "mooncake"))
    train_code, serve_code = _pair_ends(train, serve, serve, r"\[inference rank 0\] could not join the trainer: ",
                                        exit_within=(MARGIN_S, MARGIN_S))
    words = ("trainer moves P2P bytes with 'torch', this inference job with 'mooncake' (set weight_sync.p2p.backend "
             "alike on both jobs)")
    assert train_code != 0 and re.search(r"RendezvousError: \[session [\w.-]+\] inference rank 0 of job "
                                         r"'inference-\w+' cannot join session '[\w.-]+': " + re.escape(words),
                                         train.output), train.output[-4000:]
    assert serve_code == 1 and "refused this rank" in serve.output and words in serve.output, serve.output[-4000:]
    assert "the engine stays on version 0" in serve.output
    assert "synced version" not in train.output
    assert_nothing_left(config)


@pytest.mark.parametrize("fault", ["sigterm", "sigterm-deaf"])
def test_sigterm_to_the_trainer_mid_sync_ends_it_everywhere_and_the_engines_exit_0_on_the_previous_version(
        tmp_path, fault):
    """The trainer job gets SIGTERM while it sends version 2 (torchrun forwards it to every rank). Every
    trainer rank leaves at once, the leader tells the engines and ends the transfer, and the engines, which
    were receiving, leave on version 1 with exit 0. "sigterm-deaf": the leader is deaf to the signal (as a
    rank blocked in native code); its watchdog tells the engines and ends it STOP_GRACE_S after the signal."""
    from megatron_sync.drivers.callback import STOP_GRACE_S

    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml")
    demo = _demo(path, "--test-fault-during-version", fault, "2")  # timeout_s 120: nothing may wait it out
    try:
        signalled = demo.when(r"\[trainer\] fault injection: SIGTERM to the trainer job")
        bound = (STOP_GRACE_S if fault == "sigterm-deaf" else 0.0) + MARGIN_S
        for rank in (0, 1):
            demo.when(rf"\[inference rank {rank}\] stopped on version 1 \(the trainer ended the session during the "
                      r"sync of version 2: the trainer stopped (on Terminated: SIGTERM|by SIGTERM while blocked)",
                      by=within_bound(signalled, bound))
        code, _ = demo.wait(by=within_bound(signalled, bound + MARGIN_S))
    finally:
        demo.kill()
    out = demo.output
    assert "[demo] the inference job failed" not in out, out[-5000:]  # the engines exited 0
    assert re.search(r"\[trainer rank 1\] stopped by SIGTERM", out), out[-5000:]
    if fault == "sigterm-deaf":
        assert "stopped by SIGTERM while blocked" in out and "telling the engines to stop" in out, out[-5000:]
    else:
        assert re.search(r"\[trainer rank 0\] stopped by SIGTERM", out), out[-5000:]
    assert "did not stop within" not in out  # no rank was left for the demo (or torchrun) to kill
    _assert_engines_hold(tmp_path, job, 1)
    assert_nothing_left(path)


def test_a_full_disk_on_the_disk_delta_writer_leaves_the_engines_on_their_version_and_they_exit_0(tmp_path):
    """disk_delta: the trainer's writer cannot publish version 2 (its files may not grow: RLIMIT_FSIZE, as
    a full disk refuses them). The writer records the failure, the engines stop waiting for version 2 at
    once, abort it together and keep version 1; the trainer learns it from their reports, stops, and the
    engines leave on "stop" with exit 0, nobody waiting out timeout_s (120 s here)."""
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml")
    job["verify"]["dump_dir"] = None  # disk_delta keeps no copy of what it sent
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    shared = tmp_path / "shared"
    demo = _demo(path, "--test-fault-during-version", "disk-full", "2", "--weight-sync-transport", "disk_delta",
                 "--weight-sync-disk-delta-dir", str(shared), "--weight-sync-disk-delta-local-dir", str(tmp_path / "host0"))
    try:
        full = demo.when(r"\[trainer\] fault injection: the disk is full \(RLIMIT_FSIZE\) while sending version 2")
        for rank in (0, 1):
            demo.when(rf"\[inference rank {rank}\] stopped on version 1 \(the trainer ended the session: the "
                      r"trainer stopped on SyncAbortedError: sync of version 2 ", by=within_bound(full, MARGIN_S))
        code, _ = demo.wait(by=within_bound(full, 3 * MARGIN_S))
    finally:
        demo.kill()
    out = demo.output
    assert code != 0 and "[demo] the trainer job failed" in out, out[-5000:]  # the trainer fails, saying why
    assert "[demo] the inference job failed" not in out, out[-5000:]  # the engines left cleanly
    assert re.search(r"version 2 will not be published: the trainer's writer failed \(.*stage-0: version 2: "
                     r"StoreWriteError: .*(file size limit|File too large)", out), out[-5000:]
    assert "was not published" not in out  # nobody waited for it
    assert_nothing_left(path)


# ---- exit paths: nobody waits for a peer known to be gone ----

def _trainer_timing_its_close(rank: int, world_size: int, case: dict) -> dict:
    """A trainer job (`tests/support/jobs.py`'s model and settings) that syncs versions 1 and 2, the failure of
    version 2 and leaving the `with` block (telling the engines) each within its bound; returns the failure."""
    from megatron_sync.drivers.callback import WeightSyncCallback
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.drivers.sync import ACK_AFTER_BREAK_S
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.jobs import case_hf_config, sync_config

    init_megatron(seed=3)
    spec = models.ModelSpec(**case["spec"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    with contextlib.ExitStack() as stack:
        callback = stack.enter_context(WeightSyncCallback.from_config(
            sync_config(case), chunks, hf_config=case_hf_config(case), layout=ParallelLayout.from_megatron()))
        callback.sync_now()  # version 1
        failure = None
        # the dead rank's sockets closed: the sync fails at once, not after timeout_s
        with bounded(case["timeout_s"] / 2, "the sync of version 2 failing"):
            try:
                callback.sync_now()  # version 2: an engine rank dies while receiving it
            except Exception as e:  # noqa: BLE001 — the test reads it
                failure = f"{type(e).__name__}: {e}"
        # leaving the block tells the engines to stop; the dead rank is not waited for (timeout_s, 120 s)
        with bounded(ACK_AFTER_BREAK_S + MARGIN_S, "leaving the with block after the failed sync"):
            stack.close()
    return {"failure": failure}


def _engines_one_dying_at_version_2(rank: int, world_size: int, case: dict) -> int:
    """The inference job (`megatron_sync.drivers.serve`'s loop) whose rank 1 exits while it receives version 2."""
    from examples.serve_checked import _DiesMidSync
    from megatron_sync.drivers.serve import join, serve
    from tests.support.jobs import case_hf_config, sync_config

    config = sync_config(case)
    me = join(config, case_hf_config(case))
    if me.rank == 1:
        me.engine = _DiesMidSync(me.engine, 2)
    return serve(me, config, num_trainer_stages=1)


def test_after_an_engine_rank_died_mid_sync_the_trainer_does_not_wait_timeout_s_for_stop_acknowledgements():
    """Engine rank 1 dies mid-sync; the trainer's sync fails naming the broken group, and leaving the
    `with` block ("stop" to the engines) takes ACK_AFTER_BREAK_S at most instead of timeout_s: the
    survivor acknowledges at once (it leaves on version 1 with exit 0), the dead rank says nothing."""
    from tests.support.jobs import run_pair

    timeout_s = 120.0  # also how long the trainer waits for the engines to join: spawned on a loaded machine
    case = {"spec": {"family": "qwen3"}, "engines": 2, "engine_tp": 1, "timeout_s": timeout_s}
    trainer, engines = run_pair(case, timeout=240, trainer=_trainer_timing_its_close,
                                engine=_engines_one_dying_at_version_2, outcomes=True)
    (status, result), = trainer.values()
    assert status == "ok", result
    assert "weight sync of version 2 failed" in result["failure"] and "PeerFailureError" in result["failure"], \
        result["failure"]
    assert engines[1] == ("exited", 17), engines
    assert engines[0] == ("ok", 0), engines  # the survivor read "stop" and left on its version


def test_an_engine_failing_at_start_up_after_the_trainer_died_says_so_at_once(tmp_path):
    """The trainer hosted its rendezvous and was killed; an inference job then fails while starting (an
    engine that cannot compute in int8). It prints its error at once and, within a few seconds of it, that no
    trainer's rendezvous answers where it reports to; it exits after waiting REPORT_WAIT_S (30 s) for a trainer
    launched alongside to listen, not timeout_s (120 s here)."""
    from megatron_sync.session.reach import NOTICE_AFTER_S
    from tests.support.launched import Launched
    from tests.test_lifecycle import TIMEOUT_S

    model_dir, engine_config = _engine_model(tmp_path)
    train, _, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                    weight_sync={}, serve=False)
    try:
        train.when(r"hosting weight-sync session")
        train.kill()  # the trainer's node is gone
        serve = Launched(["bash", "launch/serve.sh", "--engine", "reference", "--model-dir", model_dir, "--config",
                          config, "--weight-sync-dtype", "int8"], env={"PYTHON": sys.executable, "NPROC": "1",
                                                                       "MASTER_PORT": str(free_port())})
        failed = serve.when(r"\[inference rank 0\] failed while starting: ValueError: .*int8")
        serve.when(r"no trainer's rendezvous answers at 127\.0\.0\.1:\d+ \(connection refused: nothing listens "
                   r"there\); waiting up to 30s to report this rank's start-up failure",
                   by=within_bound(failed, NOTICE_AFTER_S + MARGIN_S / 2))
        # start-up and REPORT_WAIT_S (30 s): not start-up + timeout_s (120 s)
        serve_code, _ = serve.wait(TIMEOUT_S - MARGIN_S)
    finally:
        train.kill()
    out = serve.output
    assert serve_code != 0
    assert re.search(r"\[inference rank 0\] its start-up failure was not reported: the trainer's rendezvous at "
                     r"127\.0\.0\.1:\d+ could not be reached", out), out[-4000:]
    assert "nothing answered for 30s (connection refused" in out, out[-4000:]  # REPORT_WAIT_S, not timeout_s
    assert_nothing_left(config)


def _trainer_whose_disk_fills(rank: int, world_size: int, case: dict) -> dict:
    """A disk-delta trainer job: version 1 is published; then its disk fills (RLIMIT_FSIZE) and the writer
    cannot publish version 2; the sync of version 3 raises that failure and the job leaves its `with` block.
    The failing sync and the leaving (the engines acknowledge "stop", else it waits timeout_s) are bounded."""
    import resource
    import signal

    import torch

    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.core.wait import poll
    from megatron_sync.drivers.callback import WeightSyncCallback
    from megatron_sync.transports.disk_delta.storedir import failed_versions
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.jobs import case_hf_config, sync_config
    from tests.support.timing import scaled

    init_megatron(seed=3)
    spec = models.ModelSpec(**case["spec"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    failure, warnings = None, _Warnings()
    logging.getLogger("megatron_sync").addHandler(warnings)
    with contextlib.ExitStack() as stack:
        callback = stack.enter_context(WeightSyncCallback.from_config(
            sync_config(case), chunks, hf_config=case_hf_config(case), layout=ParallelLayout.from_megatron()))
        callback.sync_now()  # version 1
        writer = callback.syncer.transport.writer
        writer.flush(timeout=case["timeout_s"])  # published
        with torch.no_grad():
            for param in chunks[0].parameters():
                param.add_(0.01)  # version 2 differs everywhere: its delta is far larger than the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        callback.sync_now()  # version 2: handed over; publishing it fails on the writer's thread
        poll(lambda: failed_versions(writer.root), within=scaled(case["timeout_s"]), what="version 2 failing")
        with bounded(MARGIN_S, "the sync after the failed publish"):
            try:
                callback.sync_now()  # version 3: the writer raises version 2's failure
            except Exception as e:  # noqa: BLE001 — the test reads it
                failure = f"{type(e).__name__}: {e}"
        with bounded(MARGIN_S, "leaving the with block after the writer failed"):
            stack.close()  # "stop"; the engines, no longer waiting for a version, acknowledge at once
    return {"failure": failure, "warnings": warnings.lines}


class _Warnings(logging.Handler):
    """The library's warnings in this process, as lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _engines_serving(rank: int, world_size: int, case: dict) -> dict:
    """The inference job (`megatron_sync.drivers.serve`'s loop); returns its exit code and the version held."""
    from megatron_sync.drivers.serve import join, serve
    from tests.support.jobs import case_hf_config, sync_config

    config = sync_config(case)
    me = join(config, case_hf_config(case))
    return {"code": serve(me, config, num_trainer_stages=1), "version": me.engine.version}


@pytest.mark.multiproc
def test_when_the_disk_delta_writer_fails_the_engines_leave_at_once_on_their_version(tmp_path):
    """disk_delta: the trainer's writer cannot publish version 2 (a full disk), and the trainer's next sync,
    whose version the writer will not take, fails and the job stops. Neither version is waited for: both are
    recorded as failed in the store, so the engines abort each at once, read "stop" and exit 0 on version 1;
    the trainer, leaving, gets their acknowledgements within MARGIN_S (not timeout_s, 120 s here)."""
    from tests.support.jobs import run_pair

    case = {"spec": {"family": "qwen3"}, "engines": 1, "engine_tp": 2, "timeout_s": 120.0,
            "weight_sync": {"transport": "disk_delta", "delta_dir": str(tmp_path / "shared"),
                            "delta_local_dir": str(tmp_path / "host0")}}
    trainer, engines = run_pair(case, timeout=300, trainer=_trainer_whose_disk_fills, engine=_engines_serving,
                                outcomes=True)
    (status, result), = trainer.values()
    assert status == "ok", result
    assert result["failure"] is not None and "StoreWriteError" in result["failure"], result["failure"]
    assert not [w for w in result["warnings"] if "did not all acknowledge 'stop'" in w], result["warnings"]
    assert engines == {0: ("ok", {"code": 0, "version": 1}), 1: ("ok", {"code": 0, "version": 1})}, engines
