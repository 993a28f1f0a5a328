"""The canary after every commit: each engine scores it, the trainer scores it with its own forward, and the
drift per engine is recorded (and, past `max_logprob_drift`, fails the sync or warns).

Engines driven by the trainer through the sync's control channel score the canary the SYNC message carries
right after they commit, and put the scores in the metrics they report; engines driven over their own API
(vLLM) are asked over it. The comparison runs on the trainer's leader; every trainer rank takes part in the
trainer's forward (a collective) and raises the same DriftError.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional, Sequence

from megatron_sync.core.canary import canary_tokens, drift
from megatron_sync.core.errors import DriftError
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.session.control import ControlChannel, Report

log = logging.getLogger("megatron_sync")


class TrainerCanary:
    """The trainer's side of the canary (`config.canary_length` or `canary_tokens`; off when neither)."""

    def __init__(self, config: Any, vocab_size: int, score: Callable[[list[int]], list[float]],
                 gather: Callable[[Any], list]) -> None:
        self.config, self.score, self.gather = config, score, gather
        on = bool(config.canary_tokens) or config.canary_length > 0
        self.tokens = canary_tokens(vocab_size, length=config.canary_length, seed=config.canary_seed,
                                    tokens=config.canary_tokens) if on else []

    @property
    def payload(self) -> dict:
        """What the SYNC message carries for the engines: the canary to score after committing."""
        return {"canary": self.tokens} if self.tokens else {}

    def check(self, version: int, metrics: SyncMetrics, *, leader: Optional[tuple[ControlChannel, Sequence[int]]],
              clients: Sequence[Any], timeout_s: float) -> None:
        """Score the canary (every trainer rank), compare with each engine's (the leader: `leader` is its
        control channel and each engine's first inference rank), record the drift in `metrics`; raise
        DriftError on every rank when an engine drifted past the bound and `on_drift` is "fail"."""
        if not self.tokens:
            return
        mine = self.score(self.tokens)
        verdict = self._compare(version, mine, leader, clients, timeout_s) if leader is not None else None
        shared = next(v for v in self.gather(verdict) if v is not None)
        metrics.drift = shared["drift"] if leader is not None else {}
        over = shared["over"]
        if not over:
            return
        words = "; ".join(f"engine {e}: max |Δ log p| {d['max']:.3g} (mean {d['mean']:.3g})"
                          for e, d in sorted(shared["drift"].items()) if e in over)
        message = (f"version {version}: the canary's scores drifted past max_logprob_drift="
                   f"{self.config.max_logprob_drift:g}: {words}; the engines hold the bytes sent but compute "
                   "differently (their config or kernels: rope base, norm epsilon, a post-processing step)")
        if self.config.on_drift == "fail":
            raise DriftError(message)
        log.warning("%s", message)

    def _compare(self, version: int, mine: list[float], leader: tuple[ControlChannel, Sequence[int]],
                 clients: Sequence[Any], timeout_s: float) -> dict:
        control, firsts = leader
        scores: dict[str, list[float]] = {}
        reports = control.collect(Report.METRICS, version, list(firsts), timeout_s) if firsts else {}
        for engine, rank in enumerate(firsts):
            canary = json.loads(reports[rank].decode()).get("canary")
            if canary:
                scores[str(engine)] = canary
        for index, client in enumerate(clients):  # engines driven over their own API: asked over it
            scores[str(index)] = client.token_logprobs(self.tokens)
        rows = {engine: drift(mine, theirs) for engine, theirs in scores.items()}
        bound = self.config.max_logprob_drift
        return {"drift": rows, "over": [e for e, d in rows.items() if bound and d["max"] > bound]}


def engine_scores(engine: Any, payload: dict) -> Optional[list[float]]:
    """Return the engine's scores of the canary a SYNC message carried (collective over the engine's ranks);
    None without a canary, or for an engine that cannot score token sequences."""
    tokens = payload.get("canary")
    if not tokens or not callable(getattr(engine, "token_logprobs", None)):
        return None
    return [round(x, 7) for x in engine.token_logprobs(list(tokens))]
