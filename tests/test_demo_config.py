"""The demo refuses a bad job file before it launches anything, naming the key; no setting is replaced."""

from __future__ import annotations

import os
import socket

import pytest
import yaml

from megatron_sync.settings.config import WeightSyncConfig
from tests.support.dist import free_port
from tests.support.timing import bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(tmp_path, edit) -> str:
    with open(os.path.join(ROOT, "configs", "demo_qwen3_moe_ep2.yaml")) as f:
        job = yaml.safe_load(f)
    job["weight_sync"]["master_port"] = free_port()
    edit(job)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


BAD_FILES = [
    (lambda j: j["model"].update(hiden_size=64), "unknown keys ['hiden_size'] in 'model:'"),
    (lambda j: j["train"].update(steps="three"), "train.steps='three' must be int"),
    (lambda j: j["train"].update(stpes=3), "unknown keys ['stpes'] in 'train:'"),
    (lambda j: j["model"].update(num_heads=True), "model.num_heads=True must be int"),
    (lambda j: (j["trainer"].update(ep=4, world_size=4), j["model"].update(num_experts=6)),
     "trainer.ep=4 must divide model.num_experts=6"),
    (lambda j: j["weight_sync"].update(engine_tp_size=3, num_inference_ranks=3),
     "weight_sync.engine_tp_size=3 must divide model.num_heads=4"),
    (lambda j: j["model"].update(family="qwen4"), "model: "),
    (lambda j: j["model"].pop("family"), "the 'model:' section must name a 'family'"),
    (lambda j: j["weight_sync"].update(family="llama"), "weight_sync.family='llama' but model.family is 'qwen3_moe'"),
    (lambda j: j["weight_sync"].update(timeout_s=-1), "weight_sync: timeout_s must be a number > 0"),
    (lambda j: j.update(trainr={}), "unknown sections ['trainr']"),
]


@pytest.mark.parametrize("edit, words", BAD_FILES, ids=[w[:40] for _, w in BAD_FILES])
def test_a_bad_job_file_is_refused_before_launch_naming_the_key(tmp_path, capsys, edit, words):
    from examples.demo import main

    with bounded(30, "refusing a bad job file"):  # before launching anything, not after a job's timeout
        code = main(["--config", _job(tmp_path, edit)])
    out = capsys.readouterr().out
    assert code == 2 and words in out, out
    assert "job pid" not in out  # nothing was launched


def test_the_demo_keeps_the_files_port_and_refuses_one_in_use(tmp_path, capsys):
    from examples.demo import main

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen(1)
        port = held.getsockname()[1]
        code = main(["--config", _job(tmp_path, lambda j: j["weight_sync"].update(master_port=port))])
    out = capsys.readouterr().out
    assert code == 2, out
    assert f"weight_sync.master_port {port} is in use on this machine" in out and "job pid" not in out


def test_no_family_is_filled_in_and_the_trainer_says_where_to_set_it(tmp_path):
    from megatron_sync.drivers.sync import build_converter

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"weight_sync": {"hf_config_path": "config.json"}}))
    config = WeightSyncConfig.from_yaml(str(path))
    assert config.family is None
    with pytest.raises(ValueError, match=r"weight_sync.family is not set: name the model family being trained"):
        build_converter(config, hf_config={"model_type": "qwen3"})
    assert WeightSyncConfig.from_yaml(str(path), defaults={"sync_on_start": True}).sync_on_start


def test_serve_reads_the_family_from_the_model_it_serves_or_says_where_to_set_it():
    from megatron_sync.drivers.serve import with_model_family
    from tests.support.models import ModelSpec, hf_config

    assert with_model_family(WeightSyncConfig(), hf_config(ModelSpec("qwen3_moe"))).family == "qwen3_moe"
    assert with_model_family(WeightSyncConfig(family="qwen3"), None).family == "qwen3"

    class Unknown:
        model_type = "gpt_neox"

    with pytest.raises(ValueError, match=r"gpt_neox.*set weight_sync.family \(or --weight-sync-family\)"):
        with_model_family(WeightSyncConfig(), Unknown())


@pytest.mark.parametrize("run_id, ok", [("run-7.a_b", True), (None, True), ("", False), ("a/b", False),
                                        ("x" * 65, False)])
def test_run_id_is_a_plain_name(run_id, ok):
    if ok:
        assert WeightSyncConfig(run_id=run_id).run_id == run_id
    else:
        with pytest.raises(ValueError, match="run_id="):
            WeightSyncConfig(run_id=run_id)


_LAUNCHER = """
import signal, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
signal.signal(signal.SIGTERM, lambda *_: None)  # like torchrun: on SIGTERM it waits for its workers
print(worker.pid, flush=True)
sys.exit(0 if worker.wait() == -9 else 3)
"""


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_a_stopped_worker_is_killed_at_once_and_the_rest_of_the_job_keeps_its_grace(capsys):
    """A job's process stopped by SIGSTOP cannot act on SIGTERM: the demo kills it at once instead of waiting out
    the grace, and the launcher that waits for it (torchrun) then exits by itself within its grace, not killed."""
    import signal
    import subprocess
    import sys

    from examples.demo import stop_job, stopped
    from megatron_sync.core.wait import poll

    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        worker = int(launcher.stdout.readline())
        os.kill(worker, signal.SIGSTOP)
        poll(lambda: stopped([worker]), within=30, what="the worker to stop")
        stop_job("trainer", launcher, grace_s=30.0)
    finally:
        stop_job("trainer", launcher, 0.0)
    assert launcher.returncode == 0  # the launcher saw its worker killed and left on its own, within its grace
    assert f"the trainer job's process {worker} is stopped (e.g. SIGSTOP) and cannot act on SIGTERM" \
        in capsys.readouterr().out
