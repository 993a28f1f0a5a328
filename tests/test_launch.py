"""The launch scripts start real jobs: a user's own training entry point and an engine from a model directory.

`launch/train.sh --module examples.custom_loop` runs a training loop that is not
the demo's (the shape a user's own entry point takes), and `launch/serve.sh`
starts reference engines built from an HF model directory (config.json plus
initial safetensors). The two jobs meet at the rendezvous; the trainer syncs
its initial weights and then after every optimizer step; the engines exit 0
on the version of the last sync.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_dir(path, family: str) -> str:
    """Write config.json and the seed-0 weights (HF checkpoint format) of the tiny `family` model."""
    from safetensors.torch import save_file

    from megatron_sync.convert import get_converter
    from tests.support.models import ModelSpec, hf_config, reference_weights

    spec = ModelSpec(family)
    config = hf_config(spec)
    config.save_pretrained(path)
    converter = get_converter(family, config, dtype=torch.float32)
    full = reference_weights(spec, seed=5)  # not the trainer's seed: the first sync must change them
    weights = {}
    for name, tensor in full.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            continue  # vocab rows are padded in Megatron; here straight HF rows are wanted
        weights.update(converter.convert(name, tensor))
    weights["model.embed_tokens.weight"] = full["embedding.word_embeddings.weight"]
    weights["lm_head.weight"] = full["output_layer.weight"]
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_train_sh_runs_a_users_own_entry_point_against_serve_sh(tmp_path):
    from tests.support.dist import free_port

    model_dir = _model_dir(tmp_path / "model", "qwen3")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"weight_sync": {
        "family": "qwen3", "hf_config_path": os.path.join(model_dir, "config.json"), "dtype": "float32",
        "master_port": free_port(), "num_inference_ranks": 1, "engine_tp_size": 1, "timeout_s": 60,
        "bucket_size_mb": 0.5,
    }}))
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen(
        ["bash", "launch/serve.sh", "--engine", "reference", "--model-dir", model_dir, "--config", str(config)],
        cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        train = subprocess.run(
            ["bash", "launch/train.sh", "--module", "examples.custom_loop", "--", "--config", str(config),
             "--steps", "2"],
            cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True, timeout=240)
        served, _ = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "[custom loop] step 2: loss" in train.stdout and "synced version 3" in train.stdout
    assert serve.returncode == 0, served[-3000:]
    assert "[inference rank 0] stopped on version 3" in served
