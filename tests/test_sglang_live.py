"""Live SGLang 0.5.23 servers (CPU, fp32) receive a Megatron trainer's weights through transport "sglang".

Two servers for the module, started by launch/serve_sglang.sh from SGLang's
own environment: A at TP=1 and B at TP=2, both serving the tiny Qwen3 of seed
0. After every sync each server's greedy tokens must equal Hugging Face
transformers' on exactly the tensors the trainer sent, and the version it
reports (on every answer and on /model_info) must be the trainer's.

SGLang 0.5.23 facts a client written from the docs gets wrong, each with a
test here that fails on such a client:
- tensor and distributed updates outside /begin_weight_update ...
  /end_weight_update answer 400 (every sync test: the client opens the session);
- CPU tensors pickled with torch's default sharing strategy kill the server's
  scheduler (the colocated test: the server must still serve afterwards);
- a refused distributed update leaves the trainer's broadcast waiting for
  ranks that never come (the refusal test: the sync must fail well within
  the group's timeout, naming SGLang's message).
"""

from __future__ import annotations

import os

import pytest

from tests.support.dist import free_port, run_distributed
from tests.support.real_engines import QWEN3, HFReference, TrainerError, TrainerProcess, hf_checkpoint
from tests.support.sglang_jobs import sglang_job_syncs
from tests.support.sglang_server import (
    SGLangServer, StreamedGeneration, serving_problems, weight_version, write_model_dir,
)
from tests.support.timing import scaled

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc]

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], [200, 1, 64, 128, 9, 31]]
TIMEOUT_S = 90  # the trainer's weight_sync.timeout_s: the update group's collectives wait this long
REFUSAL_BOUND_S = 45  # a refused or dead server is named well within TIMEOUT_S (scaled for load)
JOBS = "tests.support.sglang_jobs"


class Servers:
    def __init__(self, a: SGLangServer, b: SGLangServer) -> None:
        self.a, self.b = a, b

    def all(self) -> list[SGLangServer]:
        return [self.a, self.b]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sglang")
    model = str(folder / "model")
    write_model_dir(model, QWEN3, seed=0)
    # b caches no prefixes, so it can keep requests running over their old KV through a sync (policy "keep")
    started = [SGLangServer(model, *args, log_path=str(folder / f"server_{name}.log"), tp=tp)
               for name, tp, args in (("a", 1, ()), ("b", 2, ("--disable-radix-cache",)))]
    try:
        for server in started:
            server.wait_ready()
        yield Servers(*started)
    finally:
        for server in started:
            server.stop()


@pytest.fixture(autouse=True)
def no_stub_calls(servers):
    """Every test: no server called a function of the `sgl_kernel` stand-in."""
    yield
    for server in servers.all():
        assert not server.stub_calls(), f"{server.url} called sgl_kernel stubs {server.stub_calls()}"


@pytest.fixture(scope="module")
def trainer():
    with TrainerProcess(QWEN3) as process:
        yield process


def settings(urls: list[str], ranks: int, **overrides) -> dict:
    """Return the trainer's weight_sync settings for SGLang servers at `urls` holding `ranks` ranks in all."""
    return {"family": "qwen3", "dtype": "float32", "transport": "sglang", "master_port": free_port(),
            "num_inference_ranks": ranks, "bucket_size_mb": 0.05, "timeout_s": TIMEOUT_S,
            "engines": [f"sglang={url}" for url in urls], **overrides}


def problems_on(url: str, tensors: dict, version: str) -> list[str]:
    return serving_problems(url, HFReference(QWEN3, tensors), PROMPTS, version)


# ---------------------------------------------------------------- Megatron trains, SGLang serves


@pytest.mark.timeout(600)
def test_megatron_tp2_pp2_syncs_three_versions_into_tp1_and_tp2_servers(servers):
    """Both servers in one update group; the later stage's buckets reach SGLang through rank 0."""
    urls = [servers.a.url, servers.b.url]
    reports = run_distributed(sglang_job_syncs, 4, QWEN3, {"tp": 2, "pp": 2}, urls, settings(urls, 3), PROMPTS,
                              timeout=480)[0]
    for r in reports:
        print(f"[megatron tp2 pp2 -> sglang tp1 + tp2] version {r['version']}: sync {r['sync_s']:.2f}s, "
              f"tokens {r['tokens']}")
    assert [r["version"] for r in reports] == [1, 2, 3]
    for r in reports:
        assert not any(r["problems"].values()), f"version {r['version']}: {r['problems']}"
    assert len({tuple(r["tokens"]) for r in reports}) > 1, "training never changed the greedy tokens"


@pytest.mark.timeout(420)
def test_colocated_tensor_path_syncs_exactly_and_the_servers_survive(servers, trainer):
    """sglang_load: tensor, CPU buckets handed over in shared memory to both servers (TP=1 and TP=2)."""
    urls = [servers.a.url, servers.b.url]
    try:
        trainer.connect(**settings(urls, 3, sglang_load="tensor"))
        for seed, version in ((41, 1), (42, 2)):
            trainer.load(seed)
            assert trainer.sync() == version
            sent = trainer.sent()
            for server in servers.all():
                assert server.alive(), f"{server.url} died:\n{server.log_tail()}"
                assert not problems_on(server.url, sent, str(version)), server.url
    finally:
        trainer.disconnect()


def test_disk_path_feeds_the_server_from_the_local_copy_and_undoes_a_failed_load(servers, tmp_path):
    """Disk-delta's writer publishes versions (as a TP=1 trainer's stage source does: the HF checkpoint of
    its weights); on the engine host SGLangDiskFeeder applies each to the local copy and has the TP=2 server
    load it with /update_weights_from_disk; a load SGLang refuses (pointed at a directory without weights)
    leaves the server on the committed version, the staged one discarded."""
    from megatron_sync.transports.disk_delta import DeltaWriter
    from megatron_sync.transports.disk_delta.transport import stage_store
    from megatron_sync.transports.sglang.disk import SGLangDiskFeeder

    url, store = servers.b.url, str(tmp_path / "store")
    feeder = SGLangDiskFeeder(url, delta_dir=store, local_dir=str(tmp_path / "local"), timeout_s=TIMEOUT_S)
    try:
        with DeltaWriter(stage_store(store, 0)) as writer:
            for seed, version in ((71, 1), (72, 2), (73, 3)):
                writer.submit(version, hf_checkpoint(QWEN3, seed))
                writer.flush(timeout=scaled(120))  # each one published (a writer behind coalesces versions)
        for seed, version in ((71, 1), (72, 2)):
            assert feeder.feed(version) == version
            assert not problems_on(url, hf_checkpoint(QWEN3, seed), str(version)), version
        linked, empty = feeder._linked, tmp_path / "no_weights"
        empty.mkdir()

        def no_weights_once(files):  # the next load's directory has no weights: SGLang refuses it
            feeder._linked = linked  # (the undo that follows links the committed slot as usual)
            return str(empty)

        feeder._linked = no_weights_once
        with pytest.raises(Exception, match="update_weights_from_disk"):
            feeder.feed(3)
        assert feeder.version == 2
        assert not problems_on(url, hf_checkpoint(QWEN3, 72), "2"), "the server is not back on version 2"
        assert feeder.feed(3) == 3
        assert not problems_on(url, hf_checkpoint(QWEN3, 73), "3")
    finally:
        feeder.close()


# ---------------------------------------------------------------- faults


def test_a_refused_bucket_fails_the_sync_in_time_and_the_server_keeps_the_previous_version(servers, trainer):
    """Another client closes A's update session mid-sync: SGLang refuses the next bucket with 400 and never
    joins its broadcast. The sync fails within the bound (not the group's timeout), naming SGLang's message;
    the buckets A had loaded are undone (v1 sent again); the rebuilt group carries the next sync."""
    url = servers.a.url
    try:
        trainer.load(31)
        trainer.connect(**settings([url], 1))
        assert trainer.sync() == 1
        v1 = trainer.sent()
        trainer.call("apply", f"{JOBS}:end_session_at_bucket", url, 1)
        trainer.load(32)
        with pytest.raises(TrainerError) as failure:
            trainer.call("sync", timeout_s=scaled(REFUSAL_BOUND_S))
        assert "must run between begin_weight_update() and end_weight_update()" in failure.value.message
        assert url in failure.value.message
        assert not problems_on(url, v1, "1"), "the server does not serve version 1 exactly"
        trainer.call("apply", f"{JOBS}:clear_faults")
        trainer.load(33)
        assert trainer.sync() == 2
        assert not problems_on(url, trainer.sent(), "2")
    finally:
        trainer.disconnect()


def test_a_refused_first_sync_reloads_the_start_checkpoint(tmp_path, trainer):
    """A server that never took a version (weight_version "default") is restored from its own checkpoint."""
    server = SGLangServer(_model(tmp_path, seed=5), log_path=str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        trainer.connect(**settings([server.url], 1))
        trainer.call("apply", f"{JOBS}:end_session_at_bucket", server.url, 1)
        trainer.load(34)
        with pytest.raises(TrainerError, match="begin_weight_update"):
            trainer.call("sync", timeout_s=scaled(REFUSAL_BOUND_S))
        assert not problems_on(server.url, hf_checkpoint(QWEN3, 5), "default")
        assert not server.stub_calls()
    finally:
        try:
            trainer.call("apply", f"{JOBS}:clear_faults")
            trainer.disconnect()
        finally:
            server.stop()


def test_a_server_killed_mid_sync_is_named_and_the_other_keeps_the_previous_version(servers, trainer, tmp_path):
    """Server C dies (SIGKILL) just before bucket 1 of v2: the sync fails in time naming C; A, which loaded
    bucket 0 of v2, is given v1 again over a group rebuilt without C, and serves v1 exactly."""
    victim = SGLangServer(_model(tmp_path, seed=0), log_path=str(tmp_path / "victim.log"))
    url = servers.a.url
    try:
        victim.wait_ready()
        trainer.load(51)
        trainer.connect(**settings([url, victim.url], 2))
        assert trainer.sync() == 1
        v1 = trainer.sent()
        trainer.call("apply", f"{JOBS}:kill_at_bucket", victim.url, victim.proc.pid, 1)
        trainer.load(52)
        with pytest.raises(TrainerError) as failure:
            trainer.call("sync", timeout_s=scaled(REFUSAL_BOUND_S))
        assert victim.url in failure.value.message
        assert not victim.alive()
        assert weight_version(url) == "1"
        assert not problems_on(url, v1, "1"), "the surviving server does not serve version 1 exactly"
    finally:
        try:
            trainer.call("apply", f"{JOBS}:clear_faults")
            trainer.disconnect()
        finally:
            victim.stop()


@pytest.mark.timeout(600)  # two server starts and four syncs: about 60 s idle, over 300 s on a machine at load 30
def test_a_fleet_drops_a_server_killed_mid_sync_commits_on_the_others_and_takes_it_back_restarted(servers, trainer,
                                                                                                  tmp_path):
    """fleet.enabled over transport sglang, servers A and C. v2: C dies (SIGKILL) before bucket 1; A commits v2
    (exact tokens, reports 2) and C's row says it left. C restarted on its port (serving its start checkpoint)
    rejoins at v3 as generation 1 and both serve v3. v4: A refuses bucket 1 (its session closed by another
    client); C commits v4 while A is given v3 again, whole, and serves v3, reporting 3."""
    model = _model(tmp_path, seed=0)
    victim = SGLangServer(model, log_path=str(tmp_path / "victim.log"))
    restarted = None
    url = servers.a.url
    try:
        victim.wait_ready()
        trainer.load(61)
        trainer.connect(**settings([url, victim.url], 2, fleet={"enabled": True, "min_engines": 1}))
        first = trainer.call("sync_rows")
        assert _outcomes(first) == {0: "committed", 1: "committed"}
        assert {(e["event"], e["engine"]) for e in _events(first)} == {("joined", 0), ("joined", 1)}

        trainer.call("apply", f"{JOBS}:kill_at_bucket", victim.url, victim.proc.pid, 1)
        trainer.load(62)
        second = trainer.call("sync_rows", timeout_s=scaled(REFUSAL_BOUND_S))
        v2 = trainer.sent()
        assert second["version"] == 2 and _outcomes(second) == {0: "committed", 1: "failed"}
        assert "stopped answering" in _row(second, 1)["reason"]
        assert [(e["event"], e["engine"]) for e in _events(second)] == [("left", 1)]
        assert not victim.alive() and weight_version(url) == "2" and not problems_on(url, v2, "2")

        trainer.call("apply", f"{JOBS}:clear_faults")
        restarted = SGLangServer(model, log_path=str(tmp_path / "restarted.log"), port=victim.port)
        restarted.wait_ready()  # (assigned first: a server that fails to start is still stopped below)
        assert weight_version(restarted.url) == "default"  # its start checkpoint, until the fleet takes it back
        trainer.load(63)
        third = trainer.call("sync_rows")
        v3 = trainer.sent()
        assert _outcomes(third) == {0: "committed", 1: "committed"} and _row(third, 1)["generation"] == 1
        assert [(e["event"], e["engine"], e["generation"]) for e in _events(third)] == [("rejoined", 1, 1)]
        for server_url in (url, restarted.url):
            assert weight_version(server_url) == "3" and not problems_on(server_url, v3, "3"), server_url

        trainer.call("apply", f"{JOBS}:end_session_at_bucket", url, 1)
        trainer.load(64)
        fourth = trainer.call("sync_rows", timeout_s=scaled(REFUSAL_BOUND_S))
        v4 = trainer.sent()
        assert _outcomes(fourth) == {0: "aborted", 1: "committed"} and "400" in _row(fourth, 0)["reason"]
        assert weight_version(url) == "3" and not problems_on(url, v3, "3"), "A does not serve v3 exactly again"
        assert weight_version(restarted.url) == "4" and not problems_on(restarted.url, v4, "4")
    finally:
        try:
            trainer.call("apply", f"{JOBS}:clear_faults")
            trainer.disconnect()
        finally:
            for server in (victim, restarted):
                if server is not None:
                    server.stop()


def _outcomes(synced: dict) -> dict[int, str]:
    return {row["engine"]: row["outcome"] for row in synced["fleet"] if "outcome" in row}


def _row(synced: dict, engine: int) -> dict:
    return next(row for row in synced["fleet"] if "outcome" in row and row["engine"] == engine)


def _events(synced: dict) -> list[dict]:
    return [row for row in synced["fleet"] if "event" in row]


def _model(folder, seed: int) -> str:
    path = os.path.join(str(folder), "model")
    write_model_dir(path, QWEN3, seed=seed)
    return path


# ---------------------------------------------------------------- a sync during a long generation


@pytest.mark.parametrize("policy,length", [("abort", 2000), ("recompute", 400), ("keep", 400)])
def test_a_sync_during_a_generation_follows_the_policy_and_the_answer_names_its_version(servers, trainer, policy,
                                                                                      length):
    """abort: the generation ends, aborted, on v1's greedy tokens, reporting v1. recompute (SGLang "retract"):
    it goes back to the queue and resumes on v2, whose KV of everything so far is recomputed: the tokens after
    the switch are v2's greedy continuation; it finishes reporting v2. keep (SGLang "in_place", on the server
    without a radix cache): it stays where it is and continues on v2 over the KV v1 computed, keeping every
    token so far; it finishes reporting v2. (SGLang decodes ~10 tokens/s here; the sync lands within the
    first few.)"""
    server = servers.b if policy == "keep" else servers.a
    try:
        trainer.load(61)
        trainer.connect(**settings([server.url], 2 if server is servers.b else 1, inflight_policy=policy))
        trainer.sync()
        v1 = trainer.sent()
        trainer.load(62)  # the next version is ready before the stream starts: its sync follows at once
        generation = StreamedGeneration(server.url, PROMPTS[1], length)
        assert generation.first_tokens.wait(scaled(120)), "no tokens streamed"
        assert trainer.sync() == 2
        v2 = trainer.sent()
        tokens, finish, version = generation.result()
    finally:
        trainer.disconnect()
    print(f"[{policy}] {len(tokens)} tokens, finish {finish}, weight_version {version}")
    want, _ = HFReference(QWEN3, v1).greedy(PROMPTS[1], min(len(tokens), 200))
    on_v1 = next((i for i, (got, w) in enumerate(zip(tokens, want)) if got != w), len(want))
    assert on_v1 >= 1, f"the first token is not v1's: {tokens[:8]} vs {want[:8]}"
    if policy == "abort":
        assert finish == "abort" and 0 < len(tokens) < length and version == "1"
        assert on_v1 == len(want), f"an aborted generation left v1 at token {on_v1}"
        return
    assert finish == "length" and len(tokens) == length and version == "2"
    assert on_v1 < len(want), "the generation never left v1's greedy tokens"
    if policy == "recompute":
        assert HFReference(QWEN3, v2).check(tokens[on_v1:on_v1 + 16], PROMPTS[1] + tokens[:on_v1]) is None
