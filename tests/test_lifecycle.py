"""Operator-grade faults against the real launched jobs: named refusals, failures that travel, clean stops.

Each test launches the real jobs (`examples.demo`, `launch/train.sh` + `launch/serve.sh`, or the
harness's `run_distributed` trainer/engine pair), injects one fault, and checks what an operator
would: the message names the mismatch or the fault, the time to fail is bounded well below
`timeout_s`, engines stopped mid-way hold exactly the shards of the version they report, and no
process of the run is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

from megatron_sync.core.wait import WaitTimeout, clock, poll
from tests.support.dist import free_port
from tests.support.fakes import shard_of
from tests.support.launched import Launched, within_bound
from tests.support.timing import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120  # weight_sync.timeout_s of these runs: every failure below comes far sooner

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def processes_with(marker: str) -> list[tuple[int, str]]:
    """Return (pid, command line) of every live process whose command line mentions `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append((int(entry), cmdline))
    return found


def assert_nothing_left(marker: str, within_s: float = 10.0) -> None:
    """Every process whose command line mentions `marker` is gone within `within_s` (scaled)."""
    try:
        poll(lambda: not processes_with(marker), within=scaled(within_s), what=f"the processes of {marker} ending")
    except WaitTimeout:
        pass
    assert not processes_with(marker), processes_with(marker)


SMALL = {"trainer": {"world_size": 1, "tp": 1}, "weight_sync": {"num_inference_ranks": 1, "engine_tp_size": 1}}
"""One trainer rank, one engine rank: the cheapest pair of real jobs, for faults that need no more."""


def _demo_job(tmp_path, config: str, changes: dict | None = None) -> tuple[str, dict]:
    with open(os.path.join(ROOT, "configs", config)) as f:
        job = yaml.safe_load(f)
    for section, values in (changes or {}).items():
        job[section].update(values)
    job.setdefault("verify", {}).update(dump_dir=str(tmp_path / "dumps"))
    job["weight_sync"].update(master_port=free_port(), timeout_s=TIMEOUT_S)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path), job


def _demo(path: str, *flags: str) -> Launched:
    return Launched([sys.executable, "-m", "examples.demo", "--config", path, "--time-limit", "280", *flags])


def _assert_engines_hold(tmp_path, job: dict, version: int) -> None:
    """Every engine rank's stop-time dump is version `version`, shard for shard equal to what it held then."""
    ws = job["weight_sync"]
    for engine in range(ws["num_inference_ranks"] // ws["engine_tp_size"]):
        for tp_rank in range(ws["engine_tp_size"]):
            held = torch.load(tmp_path / "dumps" / f"survivor_engine{engine}_rank{tp_rank}.pt")
            before = torch.load(tmp_path / "dumps" / f"v{version}" / f"engine{engine}_rank{tp_rank}.pt")
            assert held["version"] == before["version"] == version
            assert set(held["shards"]) == set(before["shards"])
            for name, shard in held["shards"].items():
                assert torch.equal(shard, before["shards"][name]), (engine, tp_rank, name)


# ---- lifecycle: the demo's two jobs ----

def test_sigterm_to_the_demo_stops_the_trainer_which_stops_the_engines_cleanly(tmp_path):
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml", SMALL)
    demo = _demo(path, "--test-pause-after-version", "2")
    try:
        demo.when(r"\[trainer\] fault injection: idling after version 2")
        demo.proc.send_signal(signal.SIGTERM)
        code, _ = demo.wait(20)  # the demo stops both jobs at once, not after a timeout
    finally:
        demo.kill()
    out = demo.output
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert f"[demo] rendezvous at 127.0.0.1:{job['weight_sync']['master_port']}" in out  # the file's port
    # the trainer said stop: the engine exits 0 on the version it holds, saying why
    assert ("[inference rank 0] stopped on version 2 (the trainer ended the session: the trainer "
            "stopped on Terminated: SIGTERM)") in out, out[-4000:]
    assert "[trainer rank 0] stopped by SIGTERM" in out
    assert "the trainer job failed" not in out and "inference job failed" not in out
    _assert_engines_hold(tmp_path, job, 2)
    assert_nothing_left(path)


def test_a_hung_engine_rank_reports_its_version_on_sigterm_and_the_demo_stops_the_trainer(tmp_path):
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml", {"trainer": SMALL["trainer"]})
    demo = _demo(path, "--test-hang-during-version", "2")
    try:
        demo.when(r"fault injection: hanging while receiving version 2")
        inference_pid = int(re.search(r"inference job pid (\d+)", demo.output).group(1))
        # the other engine rank and the trainer may or may not be blocked in the sync yet: either way each
        # rank reports on SIGTERM
        os.killpg(inference_pid, signal.SIGTERM)  # what torchrun, a scheduler or an operator does
        code, _ = demo.wait(30)  # not timeout_s (120 s): the demo stopped the trainer
    finally:
        demo.kill()
    out = demo.output
    assert code != 0
    for rank in (0, 1):  # both blocked (one deaf to signals): each still reports, via the watchdog if need be
        assert re.search(rf"\[inference rank {rank}\] stopped by SIGTERM.*; the engine stays on version 1", out), \
            out[-5000:]
    assert re.search(r"\[inference rank 1\] stopped by SIGTERM while blocked", out), out[-5000:]
    assert "[demo] the inference job failed" in out and "stopping the trainer job" in out
    _assert_engines_hold(tmp_path, job, 1)
    assert_nothing_left(path)


def test_an_idle_engine_whose_trainer_is_killed_says_so(tmp_path):
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml", SMALL)
    demo = _demo(path, "--test-pause-after-version", "2")
    try:
        demo.when(r"\[trainer\] fault injection: idling after version 2")
        trainer_pid = int(re.search(r"trainer job pid (\d+)", demo.output).group(1))
        from examples.demo import descendants

        killed = clock().now()
        for pid in [trainer_pid, *descendants(trainer_pid)]:  # the trainer's node is gone
            os.kill(pid, signal.SIGKILL)
        demo.when(r"\[inference rank 0\] the trainer went away while this engine was idle", by=within_bound(killed, 5))
        code, _ = demo.wait(20)
    finally:
        demo.kill()
    out = demo.output
    assert code != 0
    assert ("[inference rank 0] the trainer went away while this engine was idle: its rendezvous at "
            f"127.0.0.1:{job['weight_sync']['master_port']} stopped answering (it exited without 'stop'); no "
            "sync was running, the engine holds version 2") in out, out[-4000:]
    assert "sync of version" not in out.split("idling after version 2")[-1]  # nobody speaks of a sync failing
    _assert_engines_hold(tmp_path, job, 2)
    assert_nothing_left(path)


# ---- the join handshake and start-up failures, through the launch scripts ----

def _launch_pair(tmp_path, *, trainer_config: dict, engine_model_dir: str, weight_sync: dict,
                 trainer_args: tuple[str, ...] = (), engine_args: tuple[str, ...] = (), serve: bool = True
                 ) -> tuple[Launched, Launched | None, str]:
    trainer_dir = tmp_path / "trainer_model"
    trainer_dir.mkdir()
    (trainer_dir / "config.json").write_text(json.dumps(trainer_config))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"weight_sync": {
        "family": "qwen3", "dtype": "float32", "master_port": free_port(), "num_inference_ranks": 1,
        "engine_tp_size": 1, "timeout_s": TIMEOUT_S, "bucket_size_mb": 0.5,
        "hf_config_path": str(trainer_dir / "config.json"), **weight_sync,
    }}))
    env = {"PYTHON": sys.executable, "NPROC": "1"}
    serve = Launched(["bash", "launch/serve.sh", "--engine", "reference", "--model-dir", engine_model_dir,
                      "--config", str(config), *engine_args], env={**env, "MASTER_PORT": str(free_port())}
                     ) if serve else None
    train = Launched(["bash", "launch/train.sh", "--module", "examples.custom_loop", "--", "--config", str(config),
                      "--steps", "2", *trainer_args], env={**env, "MASTER_PORT": str(free_port())})
    return train, serve, str(config)


def _pair_ends(train: Launched, serve: Launched, since: Launched, pattern: str, *,
               exit_within: tuple[float, float] = (120.0, 60.0)) -> tuple[int, int]:
    """Wait for `since` to print a line matching `pattern`, then for the trainer and the engine to exit, each
    within its bound of `exit_within` (seconds after that line, scaled); return their exit codes."""
    try:
        seen = since.when(pattern)
        train_code, _ = train.wait(by=within_bound(seen, exit_within[0]))
        serve_code, _ = serve.wait(by=within_bound(seen, exit_within[1]))
    finally:
        train.kill()
        serve.kill()
    return train_code, serve_code


def _failed_pair(train: Launched, serve: Launched, *, trainer_exits_within: float = 15.0) -> tuple[int, int]:
    """Wait for both jobs, the trainer exiting within `trainer_exits_within` of hosting its session (scaled)
    and the engine within 60 s; return their exit codes."""
    return _pair_ends(train, serve, train, r"hosting weight-sync session", exit_within=(trainer_exits_within, 60.0))


def _engine_model(tmp_path) -> tuple[str, dict]:
    from tests.test_launch import _model_dir

    model_dir = _model_dir(tmp_path / "engine_model", "qwen3")
    with open(os.path.join(model_dir, "config.json")) as f:
        return model_dir, json.load(f)


def test_a_model_differing_only_in_rope_theta_is_refused_before_any_byte_moves(tmp_path):
    model_dir, engine_config = _engine_model(tmp_path)
    trainer_config = json.loads(json.dumps(engine_config))
    trainer_config["rope_parameters"]["rope_theta"] = 1e6  # the trainer's HF config; the engine has 1e4
    # the trainer's Megatron model agrees with its own HF config (else the trainer refuses it itself)
    train, serve, config = _launch_pair(tmp_path, trainer_config=trainer_config, engine_model_dir=model_dir,
                                        weight_sync={}, trainer_args=("--rotary-base", "1e6"))
    train_code, serve_code = _failed_pair(train, serve)
    words = "the models differ in rope_parameters.rope_theta: trainer 1000000.0, this inference job 10000.0"
    assert train_code != 0 and words in train.output, train.output[-4000:]
    assert serve_code == 1 and words in serve.output, serve.output[-4000:]
    assert "refused this rank" in serve.output
    assert "the engine stays on version 0" in serve.output  # its initial weights: nothing was received
    assert "synced version" not in train.output
    assert_nothing_left(config)


def test_an_engine_that_fails_at_start_up_fails_the_trainer_within_seconds_quoting_it(tmp_path):
    model_dir, engine_config = _engine_model(tmp_path)
    train, serve, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                        weight_sync={"dtype": "int8"})  # the engine cannot compute in int8
    train_code, serve_code = _failed_pair(train, serve)
    why = "Qwen3ForCausalLM cannot be instantiated under `dtype=torch.int8`"
    assert serve_code != 0 and "[inference rank 0] failed while starting: ValueError: " in serve.output
    assert "[inference rank 0] its start-up failure was reported to the trainer" in serve.output, serve.output[-4000:]
    assert train_code != 0 and re.search(r"inference rank 0 of job 'inference-\w+' failed while starting: "
                                         r"ValueError: .*" + re.escape(why), train.output), train.output[-4000:]
    assert_nothing_left(config)


# ---- two inference jobs on one address ----

def test_a_second_inference_job_is_refused_by_session_name_and_the_first_keeps_syncing_exactly(tmp_path):
    import multiprocessing

    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.session.session import connect
    from tests.support.dist import run_distributed, run_ranks
    from tests.support.jobs import engine_job, trainer_job
    from tests.support.models import ModelSpec, hf_config

    release = tmp_path / "release"
    case = {"port": free_port(), "spec": {"family": "qwen3"}, "engines": 1, "engine_tp": 1, "layout": {},
            "versions": 3, "timeout_s": 60.0, "hold": {"after_version": 1, "until_file": str(release)}}
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_distributed, trainer_job, 1, case, timeout=240)
        first = pool.submit(run_distributed, engine_job, 1, case, timeout=240)
        store = connect("127.0.0.1", case["port"], timeout_s=120)
        # the first job was admitted and the session formed
        poll(lambda: store.check(["rdzv/ready"]), within=scaled(120), what="the first engine job's admission")
        store.close()
        # a second engine job on the same address: refused at once (spawn + imports), not after timeout_s
        second = run_ranks(engine_job, 1, case, timeout=scaled(case["timeout_s"]))
        release.touch()
        sent = trainer.result(timeout=240)[0]["sent"]
        held = first.result(timeout=240)[0]["held"]
    status, message = second[0]
    assert status == "RendezvousError", (status, message)
    assert re.search(r"refused this rank: session '[\w.-]+' already has inference job 'inference-\w+' "
                     r"\(1 of 1 inference ranks joined\); this inference job 'inference-\w+' is refused", message)
    assert [h["version"] for h in held] == [1, 2, 3]
    slicer = ReferenceEngine(hf_config(ModelSpec("qwen3")), tp_rank=0, tp_size=1)
    for version, h in enumerate(held):
        assert set(h["shards"]) == set(sent[version])
        for name, shard in h["shards"].items():
            assert torch.equal(shard, shard_of(slicer, name, sent[version][name])), (version, name)
    assert not multiprocessing.active_children()


def test_a_signal_while_an_engine_rank_leaves_is_said_with_the_version_it_holds():
    """torchrun stops an engine rank (SIGTERM) when its sibling exits while this one still waits on a silent
    trainer to hear that it leaves: the rank says so with its version, and exits with the signal's code."""
    from megatron_sync.core.lifecycle import Terminated
    from megatron_sync.drivers.serve import _leave

    class LeavingWhileSignalled:  # the weight sync, closing when the signal lands
        def close(self, why: str) -> None:
            raise Terminated(signal.SIGTERM)

    class Leaving:
        def close(self, why: str) -> None:
            self.why = why

    said: list[str] = []
    assert _leave(LeavingWhileSignalled(), "", said.append, None) == 128 + signal.SIGTERM
    assert said == ["stopped by SIGTERM while leaving"]
    quiet = Leaving()
    assert _leave(quiet, "PeerFailureError: gone", said.append, 1) == 1 and quiet.why == "PeerFailureError: gone"
    assert len(said) == 1
