"""Step-by-step generation whose weights change only at a step boundary agreed by every engine rank.

A `GenerationServer` runs on each rank of one engine (same prompts on every
rank, like the engine's own collectives). It decodes one token per request per
step, each request with its own transformers KV cache. A weight sync runs in a
background thread (`run_in_background`): the receiver stages and agrees as
usual, then calls `server.commit(shards, version)`, which

- applies the version at once when this rank is not generating, or
- hands the shards to the generation loop and waits (bounded by
  `commit_timeout_s`) until they are applied at a step boundary.

Before every step the ranks all-reduce a few integers over the engine group:
the live version, the version each would run next (a staged commit's, else
the live one) and a fingerprint of the requests. A staged version is applied
at the first boundary where every rank offers the same one, so all ranks
switch between the same two tokens; if they differ the step runs on the old
weights everywhere and the offer stands for the next boundary. What happens to
requests in flight at a switch is the `inflight_policy` (see INFLIGHT_POLICIES
in config): "abort" ends them, "wait" lets them finish on the old weights and
applies the version once generation ends (vLLM's pause mode "wait"; the
commit still waits at most `commit_timeout_s`), "recompute" drops their KV
cache and re-prefills prompt + generated tokens under the new weights (SGLang's
retract, vLLM's clear_cache), "keep" decodes on with the new weights over the
old KV cache (SGLang's in_place, vLLM's keep), which the response records as
off-policy KV.

Every response carries `weight_versions` spans over its generated tokens and
`kv_versions` spans over the positions whose cached keys/values the final token
attended to, so a trainer can tell exactly which policy produced what.
"""

from __future__ import annotations

import enum
import json
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sync.core.agreement import Gather, describe, failures_of, torch_gather
from megatron_sync.settings.config import INFLIGHT_POLICIES
from megatron_sync.core.wait import Deadline, clock
from megatron_sync.core.errors import AgreedFailure

Span = tuple[int, int, int]  # (version, start, end), end exclusive


@dataclass
class Response:
    """One finished request: its tokens and which weight versions produced them."""

    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    """"length" (max_new_tokens reached), "stop" (eos), or "aborted" (a commit under policy "abort")."""
    weight_versions: list[Span]
    """(version, start, end): tokens[start:end] were chosen from logits of that version's weights."""
    kv_versions: list[Span]
    """(version, start, end): positions [start, end) of prompt + tokens whose cached keys/values the
    last token attended to were computed by that version (the last token itself is never cached)."""

    @property
    def off_policy_kv(self) -> bool:
        """True when the last token attended to keys/values of another version than its own (policy "keep")."""
        return any(v != self.weight_versions[-1][0] for v, _, _ in self.kv_versions)


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    cache: Any = None  # the engine's KV cache; None until (re)prefilled
    weight_versions: list[list[int]] = field(default_factory=list)
    kv_versions: list[list[int]] = field(default_factory=list)
    finish_reason: Optional[str] = None

    @property
    def in_flight(self) -> bool:
        """True once the request has tokens and has not finished: a switch now changes its policy."""
        return self.finish_reason is None and bool(self.tokens)

    def response(self) -> Response:
        covered = [i for _, s, e in self.weight_versions for i in range(s, e)]
        assert covered == list(range(len(self.tokens))), (self.weight_versions, len(self.tokens))
        return Response(list(self.prompt), list(self.tokens), self.finish_reason,
                        [tuple(s) for s in self.weight_versions], [tuple(s) for s in self.kv_versions])


def _extend(spans: list[list[int]], version: int, start: int, end: int) -> None:
    """Record [start, end) as computed by `version`, merging with the last span when contiguous."""
    if spans and spans[-1][0] == version and spans[-1][2] == start:
        spans[-1][2] = end
    else:
        spans.append([version, start, end])


class _State(enum.Enum):
    STAGED = "staged"  # waiting for a boundary; may be withdrawn on timeout
    OFFERED = "offered"  # in this boundary's agreement; the outcome decides
    APPLIED = "applied"
    FAILED = "failed"
    WITHDRAWN = "withdrawn"


@dataclass
class _Commit:
    shards: dict[str, torch.Tensor]
    version: int
    state: _State = _State.STAGED
    error: Optional[BaseException] = None


class GenerationServer:
    """Greedy generation on one engine rank, with weight commits only at agreed step boundaries.

    `engine` provides `version`, `load_shards(shards, version)` and
    `forward_cached(tokens, cache) -> (logits, cache)` (the ReferenceEngine
    does); `engine_group` is the process group of this engine's ranks (None: an
    engine of one rank), over which the engine computes and the boundaries are
    agreed. While a server is in use, the engine's collectives go through it only.
    """

    def __init__(self, engine: Any, *, engine_group: Optional[dist.ProcessGroup], inflight_policy: str,
                 commit_timeout_s: float = 60.0, eos_token_id: Optional[int] = None) -> None:
        if inflight_policy not in INFLIGHT_POLICIES:
            raise ValueError(f"inflight_policy={inflight_policy!r} is not valid; use one of {list(INFLIGHT_POLICIES)}")
        if not commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s={commit_timeout_s} must be > 0 seconds")
        self.engine, self.engine_group, self.inflight_policy = engine, engine_group, inflight_policy
        self.commit_timeout_s, self.eos_token_id = commit_timeout_s, eos_token_id
        self.commit_log: list[tuple[int, Optional[int]]] = []
        """(version, step) of every applied commit; step None when no generation was running."""
        self._gather: Gather = torch_gather(engine_group) if engine_group is not None else (lambda obj: [obj])
        self._rank = dist.get_rank(engine_group) if engine_group is not None else 0
        self._cond = threading.Condition()
        self._generating = False
        self._pending: Optional[_Commit] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._receiving: Optional[Future] = None  # the latest background receive

    # ---- the weight side (any thread) ----

    def commit(self, shards: dict[str, torch.Tensor], version: int) -> None:
        """Make `version` live: at once when idle, else at the next agreed step boundary (waits for it).

        Pass as `WeightReceiver(..., commit=server.commit)`. Raises TimeoutError
        (the version is withdrawn, the engine keeps the old one) when no
        boundary takes it within `commit_timeout_s`, or the load's error.
        """
        with self._cond:
            if self._pending is not None:
                raise RuntimeError(f"commit of version {version} while version {self._pending.version} "
                                   "is still pending; commits are sequential")
            pending = _Commit(shards, version)
            if not self._generating:
                self._apply_idle(pending)
            else:
                self._pending = pending
                self._cond.notify_all()
                self._await_boundary(pending)
        if pending.error is not None:
            raise pending.error

    def _await_boundary(self, pending: _Commit) -> None:
        deadline = Deadline.after(self.commit_timeout_s)
        while pending.state in (_State.STAGED, _State.OFFERED):
            remaining = deadline.at - clock().now()
            if remaining <= 0 and pending.state is _State.STAGED:
                pending.state, self._pending = _State.WITHDRAWN, None
                pending.error = TimeoutError(
                    f"[engine rank {self._rank}] version {pending.version} was not applied at a step boundary "
                    f"within commit_timeout_s={self.commit_timeout_s:g}; withdrawn (the engine keeps version "
                    f"{self.engine.version}); raise commit_timeout_s or check that every engine rank is serving"
                )
                return
            self._cond.wait(timeout=max(remaining, 0.05))

    def _apply_idle(self, pending: _Commit) -> None:
        """Load a commit while no generation runs (caller holds the lock)."""
        try:
            self.engine.load_shards(pending.shards, pending.version)
            pending.state = _State.APPLIED
            self.commit_log.append((pending.version, None))
        except Exception as e:  # handed to the committing thread
            pending.state, pending.error = _State.FAILED, e
        self._pending = None
        self._cond.notify_all()

    def run_in_background(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` (a receive whose commit is `server.commit`) in this server's background
        thread, so generation goes on meanwhile; return its future."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-receive")
        self._receiving = self._executor.submit(fn, *args)
        self._receiving.add_done_callback(self._notify)
        return self._receiving

    def _notify(self, _future: Any = None) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_for_commit(self, version: int, timeout: float) -> None:
        """Block until `version` is staged for the next boundary or already live; raise the background
        receive's error when it ended without it (TimeoutError after `timeout`)."""
        def committed() -> bool:
            staged = self._pending is not None and self._pending.version == version
            return staged or self.engine.version >= version

        def ready() -> bool:
            return committed() or (self._receiving is not None and self._receiving.done())

        with self._cond:
            if not self._cond.wait_for(ready, timeout=timeout):
                raise TimeoutError(f"[engine rank {self._rank}] version {version} was not committed "
                                   f"within {timeout:g}s (live version {self.engine.version})")
            if committed():
                return
        self._receiving.result()  # raises the receive's error
        raise RuntimeError(f"[engine rank {self._rank}] version {version} was not committed: its sync was "
                           f"aborted on every rank (live version {self.engine.version})")

    def close(self) -> None:
        """Wait for a running receive to finish and stop the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- the generation side (the rank's main thread) ----

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 before_step: Optional[Callable[[int], None]] = None) -> list[Response]:
        """Return one greedy Response per prompt; collective over the engine group (same prompts everywhere).

        `before_step(step)` is called before each step's boundary, where step is
        the number of tokens every unfinished request has (a test hook to
        commit at a chosen boundary).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        requests = [_Request([int(t) for t in p], max_new_tokens) for p in prompts]
        fingerprint = zlib.crc32(json.dumps([[r.prompt for r in requests], max_new_tokens]).encode())
        self._set_generating(True)
        try:
            step = 0
            while any(r.finish_reason is None for r in requests):
                if before_step is not None:
                    before_step(step)
                self._boundary(requests, step, fingerprint)
                for request in requests:
                    if request.finish_reason is None:
                        self._decode(request)
                step += 1
        finally:
            self._set_generating(False)
        return [r.response() for r in requests]

    def _set_generating(self, generating: bool) -> None:
        with self._cond:
            if generating and self._generating:
                raise RuntimeError("generate() is already running on this rank; call it from one thread")
            self._generating = generating
            if not generating and self._pending is not None and self._pending.state is _State.STAGED:
                self._apply_idle(self._pending)  # generation ended first; nothing in flight any more

    def _decode(self, request: _Request) -> None:
        """Choose one token for `request`, prefilling prompt + tokens first when it has no cache."""
        version = self.engine.version
        sequence = request.prompt + request.tokens
        start = len(sequence) - 1 if request.cache is not None else 0
        logits, request.cache = self.engine.forward_cached(torch.tensor([sequence[start:]]), request.cache)
        _extend(request.kv_versions, version, start, len(sequence))
        _extend(request.weight_versions, version, len(request.tokens), len(request.tokens) + 1)
        token = int(logits[0, -1].argmax())
        request.tokens.append(token)
        if token == self.eos_token_id:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = "length"

    def _boundary(self, requests: list[_Request], step: int, fingerprint: int) -> None:
        """Agree with the other engine ranks whether a staged version goes live before this step."""
        waiting_since: Optional[float] = None
        # "wait": nothing switches while a request is in flight; the version is applied when generate() ends
        holding = self.inflight_policy == "wait" and any(r.in_flight for r in requests)
        while True:
            offer = None if holding else self._offer()
            live = self.engine.version
            target = offer.version if offer is not None else live
            late = waiting_since is not None and clock().now() - waiting_since > self.commit_timeout_s
            agreed = self._max([live, -live, target, -target, int(offer is not None), int(late),
                                fingerprint, -fingerprint])
            live_max, live_min, target_max, target_min = agreed[0], -agreed[1], agreed[2], -agreed[3]
            any_offer, any_late = agreed[4], agreed[5]
            if agreed[6] != -agreed[7]:
                self._withdraw_offer(offer)
                raise ValueError(f"[engine rank {self._rank}] engine ranks called generate() with different "
                                 "prompts or max_new_tokens; pass the same requests on every rank")
            if target_max == target_min:
                if any_offer:  # every rank runs `target` from here on: the offering ranks switch now
                    self._switch(offer, requests, step)
                return
            self._withdraw_offer(offer)
            if live_max == live_min:
                return  # a peer's commit has not arrived: this step runs on the old weights everywhere
            # A rank applied a version while idle before this generation began; the others' commits of it
            # are on their way (every rank passed the receiver's agreement). Wait for them.
            if step > 0:
                raise RuntimeError(f"[engine rank {self._rank}] engine ranks hold versions {live_min}.."
                                   f"{live_max} at step {step}; generation would mix versions")
            if any_late:
                raise TimeoutError(f"[engine rank {self._rank}] engine ranks hold versions {live_min}..{live_max} "
                                   f"and the lagging commit did not arrive within {self.commit_timeout_s:g}s")
            waiting_since = waiting_since or clock().now()
            clock().sleep(0.001)  # one agreement round per millisecond at most while a peer's commit is on its way

    def _offer(self) -> Optional[_Commit]:
        """Return the staged commit, now locked into this boundary's agreement (None if none)."""
        with self._cond:
            if self._pending is None or self._pending.state is not _State.STAGED:
                return None
            self._pending.state = _State.OFFERED
            return self._pending

    def _withdraw_offer(self, offer: Optional[_Commit]) -> None:
        if offer is not None:
            with self._cond:
                offer.state = _State.STAGED
                self._cond.notify_all()

    def _switch(self, offer: Optional[_Commit], requests: list[_Request], step: int) -> None:
        """Load the agreed version (ranks that already hold it load nothing), then apply the policy."""
        error: Optional[str] = None
        if offer is not None:
            try:
                self.engine.load_shards(offer.shards, offer.version)
            except Exception as e:  # noqa: BLE001 — agreed on below, then raised on every engine rank
                error = describe(e, limit=3)
        failures = failures_of(self._gather(error))
        failure = AgreedFailure(f"[engine rank {self._rank}] loading the weights at step {step} (generation "
                                "stopped on every engine rank)", failures) if failures else None
        if offer is not None:
            with self._cond:
                offer.state, offer.error = (_State.FAILED, failure) if failure else (_State.APPLIED, None)
                self._pending = None
                if not failure:
                    self.commit_log.append((offer.version, step))
                self._cond.notify_all()
        if failure is not None:
            raise failure
        for request in requests:
            if request.in_flight:
                self._apply_policy(request)

    def _apply_policy(self, request: _Request) -> None:
        if self.inflight_policy == "abort":
            request.finish_reason, request.cache = "aborted", None
        elif self.inflight_policy == "recompute":
            request.cache = None  # the next step re-prefills prompt + tokens under the new weights
            request.kv_versions.clear()
        # "keep": decode on over the old cache; _decode records the new version's KV positions

    def _max(self, values: list[int]) -> list[int]:
        """Return the element-wise maximum of `values` over the engine group (the boundary negotiation)."""
        return [max(column) for column in zip(*self._gather(values))]
