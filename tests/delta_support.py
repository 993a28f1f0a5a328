"""Shared helpers of the disk-delta tests: a small seeded model and RL-like sparse updates."""

from __future__ import annotations

import contextlib

import torch

from megatron_sync.transports.disk_delta import DeltaReader, DeltaWriter, WriterOptions
from tests.support.fakes import shard_of

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


# ----------------------------------------------------------------------------- real Megatron updates


@contextlib.contextmanager
def bf16_rounded(chunks):
    """Temporarily round every parameter of `chunks` to bf16 values (kept in its own dtype)."""
    saved = [(p, p.detach().clone()) for chunk in chunks for p in chunk.parameters()]
    with torch.no_grad():
        for param, _ in saved:
            param.copy_(param.to(torch.bfloat16).to(param.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)


def changed_fraction(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """Return the fraction of bf16 elements whose bits differ between two versions."""
    changed = total = 0
    for name, tensor in new.items():
        if tensor.dtype == torch.bfloat16:
            changed += int((tensor.view(torch.int16) != old[name].view(torch.int16)).sum())
            total += tensor.numel()
    return changed / max(total, 1)


def baseline_bytes(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], level: int = 3) -> int:
    """Return the size of the field's baseline on this update: bytewise XOR, then zstd, per whole tensor."""
    from megatron_sync.transports.disk_delta import codec

    total = 0
    for name, tensor in new.items():
        a, b = tensor.reshape(-1).view(torch.uint8).numpy(), old[name].reshape(-1).view(torch.uint8).numpy()
        total += len(codec.CODECS["xor_zstd"].encode(codec._Tensor(a, b, tensor.element_size()), level))
    return total


def megatron_delta_chain(rank: int, world_size: int, spec, steps: int, lr: float, root: str, local: str,
                         options: WriterOptions) -> list[dict]:
    """In a gloo worker: train `spec` with Adam at `lr`, publish the bf16 replica after every step through
    the delta store, apply it on a reader, load it into a reference engine; return one row per version.

    Version 1 is the initial weights; versions 2..steps+1 follow optimizer steps. Each row holds sizes,
    timings, the changed fraction, whether the reader's copy equals the replica bit for bit, and the max
    |engine logits - trainer logits| (the trainer's forward with its weights rounded to bf16, the engine
    in float32 with the bf16 weights: the same function of the same weights).
    """
    from megatron_sync.convert import get_converter
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron()
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    layout, config = ParallelLayout.from_megatron(), models.hf_config(spec)
    model = wrap_in_ddp(chunks)
    optimizer = make_optimizer(model, lr)
    stream = MegatronWeightStream(model, layout, get_converter(spec.family, config, dtype=torch.bfloat16))
    engine = ReferenceEngine(config, tp_rank=0, tp_size=1, group=None, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    eval_tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=gen)
    writer, reader = DeltaWriter(root, options), DeltaReader(root, local, reader_id="host0")
    rows, previous = [], None
    for version in range(1, steps + 2):
        if version > 1:
            train_step(model, optimizer, torch.randint(0, spec.vocab_size, (2, 16), generator=gen), layout)
        replica = {name: tensor.clone() for name, tensor in stream}
        writer.submit(version, replica)
        writer.flush(timeout=600)
        staged = reader.stage()
        exact = all(torch.equal(staged.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in replica.items())
        stale_logits = engine.logits(eval_tokens)  # negative control: the engine still on the previous version
        engine.load_shards({n: shard_of(engine, n, t.float()) for n, t in staged.tensors.items()}, version)
        reader.commit(staged)
        with bf16_rounded(chunks):
            trainer_logits = models.megatron_logits(chunks, eval_tokens)
        stats = writer.stats[-1]
        rows.append(dict(
            version=version, bit_exact=exact and staged.tensors.keys() == replica.keys(),
            logits_diff=float((engine.logits(eval_tokens) - trainer_logits).abs().max()),
            stale_logits_diff=float((stale_logits - trainer_logits).abs().max()),
            changed=changed_fraction(replica, previous) if previous else None,
            baseline_bytes=baseline_bytes(replica, previous) if previous else None,
            raw_bytes=stats.raw_bytes, delta_bytes=stats.delta_bytes, snapshot_bytes=stats.snapshot_bytes,
            publish_s=stats.seconds, stage_s=staged.seconds["verify_files"] + staged.seconds["decode"],
            commit_s=staged.seconds["commit"], plan=staged.plan.versions,
            encodings=stats.encodings))
        previous = replica
    writer.close(), reader.close()
    return rows
