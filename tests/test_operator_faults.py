"""Faults an operator found by trying them on the real launched jobs: each ends within a stated bound, named.

Each test launches the real jobs (the demo's two torchrun jobs, or `launch/train.sh` +
`launch/serve.sh`), injects one fault, and checks what an operator would: the message names
the fault and the peer, the time it takes is bounded by the configured `timeout_s` plus a
stated margin (a bound that says "does not hang", generous for a loaded 2-core machine, not a
performance figure), the engines hold exactly the previous version, and no process is left.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.test_lifecycle import (_assert_engines_hold, _demo, _demo_job, _engine_model, _launch_pair,
                                  assert_nothing_left)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

FAULT_TIMEOUT_S = 10.0  # weight_sync.timeout_s of these runs
MARGIN_S = 10.0  # start-up of a probe, process exit, a loaded machine: what a bound adds to timeout_s


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_a_trainer_stopped_mid_sync_ends_the_engines_within_timeout_s_naming_it(tmp_path, transport):
    """SIGSTOP, not death: the trainer's sockets stay open and its store accepts connections but never
    answers. Every wait of the engines (the transfer, the store's control channel) ends within timeout_s,
    the engines say the trainer is stopped or hung, keep version 1 and exit 1.

    The leader stops once an engine rank took part in the first transfer of version 2; another engine
    rank may not have read the "sync 2" message yet (P2P), and it reports from its control channel."""
    path, job = _demo_job(tmp_path, "e2e_qwen3_tp2_to_2x_tp1.yaml")
    demo = _demo(path, "--test-stop-during-version", "2", "--weight-sync-transport", transport,
                 "--weight-sync-timeout-s", str(FAULT_TIMEOUT_S))
    where = f"127.0.0.1:{job['weight_sync']['master_port']}"
    said = {
        "mid-sync": (r"sync of version 2 failed: .*from (trainer )?rank 0.*its rendezvous at " + re.escape(where)
                     + r" accepts connections but does not answer within 2s: the trainer is stopped \(e\.g\. "
                     r"SIGSTOP\) or hung; the engine stays on version 1"),
        "reading control": (r"the trainer stopped answering while this engine was idle: its rendezvous at "
                            + re.escape(where) + r" accepts connections but has not answered for 10s \(the trainer "
                            r"is stopped, e\.g\. SIGSTOP, or hung\); no sync was running, the engine holds version 1"),
    }
    try:
        stopped = demo.when(r"\[trainer\] fault injection: stopping \(SIGSTOP\) while sending version 2")
        reported = [demo.when(rf"\[inference rank {rank}\] ({'|'.join(said.values())})", 120) for rank in (0, 1)]
        failed = demo.when(r"\[demo\] the inference job failed \(exit 1\)", 120)
        code, _ = demo.wait(60)
    finally:
        demo.kill()
    out = demo.output
    assert code == 1, out[-5000:]
    assert re.search(r"\[inference rank \d\] " + said["mid-sync"], out), out[-5000:]  # at least one was mid-sync
    # timeout_s for the wait that noticed, DIAGNOSE_S (2 s) to probe the trainer's host, then the exit
    assert max(reported) - stopped < FAULT_TIMEOUT_S + MARGIN_S, (reported, stopped)
    assert failed - stopped < FAULT_TIMEOUT_S + 2 * MARGIN_S, (failed, stopped)
    _assert_engines_hold(tmp_path, job, 1)
    assert_nothing_left(path)


def test_a_megatron_model_that_differs_from_its_hf_config_is_refused_before_the_first_sync(tmp_path):
    """The trainer's Megatron model was built with rotary base 1e6; the HF config it sends under (and the
    engine's) says rope_theta 1e4. Every tensor shape agrees; the trainer refuses at start-up naming the
    value, both sides of it and the option to set, and the engine, told at once, keeps version 0."""
    model_dir, engine_config = _engine_model(tmp_path)
    train, serve, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                        weight_sync={}, trainer_args=("--rotary-base", "1e6"))
    try:
        told = serve.when(r"\[inference rank 0\] could not join the trainer: .* refused this rank: session "
                          r"'[\w.-]+' has failed: the trainer failed while starting: ")
        train_code, train_ended = train.wait(120)
        serve_code, _ = serve.wait(60)
    finally:
        train.kill()
        serve.kill()
    words = ("rotary base: the Megatron model has rotary_base=1000000.0, the HF config "
             "rope_parameters.rope_theta=10000.0 (set rotary_base (--rotary-base) to match, or send under the HF "
             "config of the model being trained: weight_sync.hf_config_path)")
    assert train_code != 0 and words in train.output, train.output[-4000:]
    assert "the Megatron model being trained and the HF config its weights are sent under define different models" \
        in train.output
    assert serve_code == 1 and words in serve.output, serve.output[-4000:]
    assert "the engine stays on version 0" in serve.output
    assert "synced version" not in train.output
    # the trainer kept its rendezvous open until the engine, still starting when it failed, was told; then left
    assert train_ended - told < MARGIN_S, train_ended - told
    assert_nothing_left(config)


def test_a_setting_only_its_transport_uses_is_compared_at_the_rendezvous(tmp_path):
    """P2P: the trainer moves bytes with torch, the inference job was started with Mooncake. Both meet at
    the rendezvous, which refuses the inference job naming the setting, both values and where to set it,
    before any transfer could time out."""
    model_dir, engine_config = _engine_model(tmp_path)
    train, serve, config = _launch_pair(tmp_path, trainer_config=engine_config, engine_model_dir=model_dir,
                                        weight_sync={"transport": "p2p", "timeout_s": FAULT_TIMEOUT_S},
                                        engine_args=("--weight-sync-p2p-backend", "mooncake"))
    try:
        refused = serve.when(r"\[inference rank 0\] could not join the trainer: ")
        train_code, train_ended = train.wait(120)
        serve_code, serve_ended = serve.wait(60)
    finally:
        train.kill()
        serve.kill()
    words = ("trainer moves P2P bytes with 'torch', this inference job with 'mooncake' (set weight_sync.p2p_backend "
             "alike on both jobs)")
    assert train_code != 0 and re.search(r"RendezvousError: \[session [\w.-]+\] inference rank 0 of job "
                                         r"'inference-\w+' cannot join session '[\w.-]+': " + re.escape(words),
                                         train.output), train.output[-4000:]
    assert serve_code == 1 and "refused this rank" in serve.output and words in serve.output, serve.output[-4000:]
    assert "the engine stays on version 0" in serve.output
    assert "synced version" not in train.output
    assert max(train_ended, serve_ended) - refused < MARGIN_S, (train_ended - refused, serve_ended - refused)
    assert_nothing_left(config)
