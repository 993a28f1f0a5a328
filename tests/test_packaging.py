"""What a production job imports is the library alone: no test support, no demo, megatron-core unpatched.

Every module of the shipped packages (`megatron_sync`, `megatron_sync.convert`) is imported
in a fresh interpreter, together with the megatron-core modules a trainer
uses; then no module of `tests`, `examples` or `bench` may be loaded, and no
function or method anywhere in megatron-core or `torch.cuda` may come from
outside megatron-core / torch (which is what a monkey-patch leaves behind).
A negative control applies the test-only CPU shim in the same way and checks
that the probe does see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import importlib, inspect, json, pkgutil, sys
import megatron.core.models.gpt, megatron.core.transformer.moe.router, megatron.core.tensor_parallel.mappings
import megatron.core.distributed.param_and_grad_buffer, megatron.core.models.common.embeddings.rotary_pos_embedding
shipped = []
for package in ("megatron_sync", "megatron_sync.convert"):
    root = importlib.import_module(package)
    shipped.append(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        importlib.import_module(info.name)
        shipped.append(info.name)
if APPLY_SHIM:
    importlib.import_module("tests.support.cpu_shim").apply_cpu_shims()
foreign = []
for name, module in list(sys.modules.items()):
    if not (name.startswith("megatron.") or name == "torch.cuda"):
        continue
    for attr, value in list(vars(module).items()):
        objects = [(attr, value)]
        if inspect.isclass(value) and getattr(value, "__module__", "") == name:
            objects += [(f"{attr}.{k}", v) for k, v in vars(value).items()]
        for label, obj in objects:
            owner = getattr(obj, "__module__", None) if callable(obj) else None
            if isinstance(owner, str) and owner.split(".")[0] in ("megatron_sync", "megatron_sync.convert", "tests", "examples", "bench"):
                foreign.append(f"{name}.{label} <- {owner}")
harness = sorted(m for m in sys.modules if m.split(".")[0] in ("tests", "examples", "bench"))
print(json.dumps({"shipped": shipped, "harness": harness, "foreign": sorted(set(foreign))}))
"""


def _probe(apply_shim: bool) -> dict:
    code = f"APPLY_SHIM = {apply_shim}\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_shipped_packages_load_no_harness_and_patch_nothing():
    result = _probe(apply_shim=False)
    assert "megatron_sync.drivers.sync" in result["shipped"] and "megatron_sync.convert.families.deepseek_v3" in result["shipped"]
    assert "megatron_sync.drivers.serve" in result["shipped"]
    assert result["harness"] == []
    assert result["foreign"] == []


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_probe_sees_a_patch_when_there_is_one():
    result = _probe(apply_shim=True)
    # tests.support.cpu_shim is examples.tiny.cpu_shim under a second name: the patches carry the module they live in
    assert any(line.endswith("<- examples.tiny.cpu_shim") for line in result["foreign"]), result["foreign"][:5]
    assert "tests.support.cpu_shim" in result["harness"] and "examples.tiny.cpu_shim" in result["harness"]
