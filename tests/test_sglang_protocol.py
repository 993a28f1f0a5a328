"""The SGLang client speaks SGLang 0.5.23's weight-update API: bodies, update group, flattened buckets.

Every request body is checked against the request classes' fields as recorded
from `sglang/srt/managers/io_struct.py` (0.5.23); SGLang silently ignores
unknown keys, so a misspelled key would otherwise pass unnoticed. The same
bodies are then validated by SGLang's own classes, and the trainer's update
group and flattened buckets are received by SGLang's own code over gloo, in a
subprocess of SGLang's environment (`.venv-sglang`, built by `make setup`:
SGLang cannot share the project's environment). The live servers are in
tests/test_sglang_live.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import PAUSE_PLANS
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import build_plan
from tests.support.dist import free_port
from tests.support.sglang_server import SHIM, sglang_python
from tests.support.timing import scaled

CHECKS = os.path.join(os.path.dirname(__file__), "support", "sglang_checks.py")

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


def _in_sglang(*args: str, payload) -> subprocess.Popen:
    """Start tests/support/sglang_checks.py in SGLang's environment with `payload` (JSON) on its stdin."""
    proc = subprocess.Popen([sglang_python(), CHECKS, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SHIM})
    proc.stdin.write(json.dumps(payload))
    proc.stdin.close()
    return proc


def _result(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        proc.wait(timeout=scaled(timeout_s))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out, err = proc.stdout.read(), proc.stderr.read()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang's check exited {proc.returncode}:\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_bodies_validate_against_sglang_own_request_classes():
    """Every body, parsed by SGLang 0.5.23's own request class the way its HTTP server does."""
    payload = {"bodies": _bodies(), "classes": requests.ROUTES}
    problems = _result(_in_sglang("bodies", payload=payload), 180)
    assert problems == {route: None for route in requests.ROUTES}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_update_group_and_buckets_interoperate_with_sglang_receiving_code():
    """The trainer's group (init_update_group) and bucket bytes, received by SGLang's own functions."""
    from megatron_sync.plan.bucket import pack_tensor
    from megatron_sync.transports.sglang import init_update_group

    port, group_name = free_port(), "megatron_sync_test"
    plan = build_plan([METAS], bucket_size_bytes=200)
    bodies = [requests.update_weights_from_distributed(b, group_name=group_name) for b in plan.buckets]
    tensors = {m.name: torch.randn(m.shape).to(m.dtype) for m in METAS}
    receiver = _in_sglang("receive", str(port), group_name, payload=bodies)
    group = None
    try:
        group, _ = init_update_group("127.0.0.1", port, 2, group_name=group_name, backend="gloo",
                                     timeout_s=scaled(120))
        for bucket in plan.buckets:
            data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            for entry in bucket.entries:
                pack_tensor(data, entry, tensors[entry.name])
            group.broadcast(data, src=0)
        got = _result(receiver, 120)
    finally:
        if group is not None:
            group.close()
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(timeout=10)
    assert got == {name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()
                   for name, t in tensors.items()}
