"""The canary: a fixed token sequence every engine scores after a commit, and the drift from the trainer's scores.

Wire checksums and the post-load check prove the engine holds the bytes the trainer sent; they cannot see an
engine that computes differently with them (a rope base or a norm epsilon of its own, a post-processing bug, a
stale draft). After each commit an engine scores the canary (log p of every token given those before it) and
the trainer compares with its own forward: the largest and the mean |Δ log p| per engine, per version.
"""

from __future__ import annotations

from typing import Sequence

import torch


def canary_tokens(vocab_size: int, *, length: int, seed: int, tokens: Sequence[int] = ()) -> list[int]:
    """Return the canary: `tokens` when given (checked against the vocabulary), else `length` ids drawn from
    the vocabulary with `seed` (the same on every rank and every run)."""
    if tokens:
        bad = [t for t in tokens if not 0 <= int(t) < vocab_size]
        if bad or len(tokens) < 2:
            raise ValueError(f"canary_tokens must be at least 2 ids in [0, {vocab_size}) (the served vocabulary); "
                             f"got {list(tokens)[:8]}")
        return [int(t) for t in tokens]
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def drift(trainer: Sequence[float], engine: Sequence[float]) -> dict[str, float]:
    """Return {"max": .., "mean": ..} of |Δ log p| between the trainer's and an engine's canary scores."""
    if len(trainer) != len(engine) or not trainer:
        raise ValueError(f"the engine scored {len(engine)} canary positions, the trainer {len(trainer)}")
    gaps = (torch.tensor(list(trainer), dtype=torch.float64) - torch.tensor(list(engine), dtype=torch.float64)).abs()
    return {"max": float(gaps.max()), "mean": float(gaps.mean())}
