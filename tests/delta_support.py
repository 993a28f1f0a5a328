"""Shared helpers of the disk-delta tests: a small seeded model and RL-like sparse updates."""

from __future__ import annotations

import torch

from megatron_sync.delta import DeltaReader, DeltaWriter, WriterOptions

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def small_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Return a few HF-named tensors: bf16 matrices (one of odd size), fp32 norms, an empty tensor."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(250, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": (torch.randn(131, 67, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "model.layers.0.mlp.e_score_correction_bias": torch.randn(7, generator=gen),
        "model.empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def sparse_update(tensors: dict[str, torch.Tensor], step: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """Return a copy where about `fraction` of each tensor's elements moved by one ulp (seeded by `step`)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, tensor in tensors.items():
        new = tensor.clone()
        mask = torch.rand(tensor.shape, generator=gen) < fraction
        new.view(_INTS[tensor.element_size()])[mask] += 1
        out[name] = new
    return out


def assert_same_bytes(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Assert equal names, dtypes, shapes and bytes."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def make_pair(tmp_path, **options) -> tuple[DeltaWriter, DeltaReader]:
    """Return a writer on `tmp_path/store` and a reader with local copy `tmp_path/local`."""
    defaults = dict(snapshot_every=4, retention=3, chunk_mb=0.004, encode_threads=2)
    writer = DeltaWriter(str(tmp_path / "store"), WriterOptions(**{**defaults, **options}))
    reader = DeltaReader(str(tmp_path / "store"), str(tmp_path / "local"), reader_id="host0")
    return writer, reader


def publish(writer: DeltaWriter, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """Submit one version and wait until it is published."""
    writer.submit(version, tensors)
    writer.flush(timeout=60)
