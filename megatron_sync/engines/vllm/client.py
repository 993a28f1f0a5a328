"""The trainer's HTTP client for a vLLM server running backend "megatron_sync" (no vLLM import).

Drives vLLM 0.32's own routes (mounted with VLLM_SERVER_DEV_MODE=1) around
each sync: /pause, /start_weight_update, /update_weights (blocks while the
workers receive, so it runs on a thread while the trainer sends),
/finish_weight_update {weight_version}, /reset_prefix_cache, /resume.

The in-flight policy (`weight_sync.inflight_policy`, which the client reads
from the rendezvous) decides both the pause mode and the cache reset, so a
caller cannot forget the reset (`PAUSE_PLANS`):

- abort:     requests in flight end (finish_reason "abort"); cache reset.
- wait:      pausing waits until requests in flight finish on the old weights; cache reset.
- recompute: requests are frozen; the reset preempts them, so on resume they
             recompute their KV cache with the new weights and continue.
- keep:      requests are frozen and continue on resume over their old KV
             cache (off-policy, recorded in their weight_versions spans).
             vLLM cannot reset the prefix cache while frozen requests hold
             blocks, so `keep` is refused unless the server runs with
             --no-enable-prefix-caching (nothing stale can then be reused).

A server running a speculative MTP draft (`--speculative-config '{"method":
"mtp", ...}'`, with `weight_sync.draft: sync`) gets the draft in the same
version: joining opens and closes a draft session first (the workers are handed
the draft model), and each version's /update_weights of the target session is
followed by /finish_weight_update, /start_draft_weight_update and the draft
session's /update_weights, which commits target and draft together
(`drivers/vllm_worker.py`). A draft model that is not the model's own MTP
layers (EAGLE, a separate draft checkpoint) is refused: the trainer does not
train it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_sync.engines.base import Rendezvous
from megatron_sync.engines.http import BackgroundCall, EngineHTTPError, request_json
from megatron_sync.engines.vllm.wire import BACKEND, JoinInfo, UpdateInfo


@dataclass(frozen=True)
class PausePlan:
    """How one in-flight policy pauses vLLM and resets its prefix cache after a new version loads."""

    mode: str
    """vLLM's pause mode: "abort", "wait" or "keep"."""
    reset_running: Optional[bool]
    """reset_running_requests of /reset_prefix_cache; None: no reset (needs prefix caching off)."""


PAUSE_PLANS = {
    "abort": PausePlan("abort", reset_running=False),
    "wait": PausePlan("wait", reset_running=False),
    "recompute": PausePlan("keep", reset_running=True),
    "keep": PausePlan("keep", reset_running=None),
}


class VLLMEngineClient:
    """One vLLM server (all its TP/PP/DP workers) driven over HTTP; an `EngineClient`.

    `timeout_s` bounds each control request and, unless `drain_timeout_s` is
    given, /pause under policy "wait" (requests in flight finish first).
    """

    def __init__(self, url: str, *, timeout_s: float = 300.0, drain_timeout_s: Optional[float] = None) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.drain_timeout_s = timeout_s if drain_timeout_s is None else drain_timeout_s
        self.plan: Optional[PausePlan] = None
        self.inflight_policy: Optional[str] = None
        self._rendezvous: Optional[Rendezvous] = None
        self._update: Optional[BackgroundCall] = None
        self._workers: Optional[int] = None
        self.draft = False  # the server runs an MTP draft, updated in a draft session of each version

    # -- start-up -----------------------------------------------------------------------------

    def num_workers(self) -> int:
        """Return the server's worker count (TP * PP * DP), each one inference rank."""
        if self._workers is None:
            self._check_backend()
            answer = self._call("/get_world_size", method="GET", query={"include_dp": True})
            self._workers = int(answer["world_size"])
        return self._workers

    def _server_config(self) -> dict:
        """Return the server's vllm_config as JSON (GET /server_info, a dev-mode route)."""
        try:
            info = self._call("/server_info", method="GET", query={"config_format": "json"})
        except EngineHTTPError as e:
            if e.status == 404:
                raise EngineHTTPError(self.url, "/server_info", "is missing: start vLLM with "
                                      "VLLM_SERVER_DEV_MODE=1 (launch/serve_vllm.sh does)") from None
            raise
        return info["vllm_config"]

    def _check_backend(self) -> None:
        backend = (self._server_config().get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise ValueError(f"vLLM at {self.url} runs weight-transfer backend {backend!r}; start it with "
                             f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' (launch/serve_vllm.sh)")

    def join(self, rendezvous: Rendezvous) -> BackgroundCall:
        """Start the workers joining the transport group (POST /init_weight_transfer_engine); return at once.

        Raises ValueError first, naming the fix, when the server cannot take
        part as configured: another dtype than the trainer sends, or policy
        "keep" with prefix caching on (checked here: an error raised inside
        vLLM 0.32's workers with TP > 1 would desynchronise its RPC replies).
        """
        config = rendezvous.config
        if config.transport == "sglang":
            raise ValueError(f"vLLM at {self.url}: weight_sync.transport 'sglang' is SGLang's own update group; "
                             "vLLM's workers join the project's transport (e.g. 'broadcast')")
        server = self._server_config()
        served = str((server.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        if served != config.dtype:
            raise ValueError(f"vLLM at {self.url} serves dtype {served!r} but the trainer sends "
                             f"{config.dtype!r}; start vLLM with --dtype {config.dtype} "
                             f"or set weight_sync.dtype: {served}")
        plan = PAUSE_PLANS[config.inflight_policy]
        if plan.reset_running is None and (server.get("cache_config") or {}).get("enable_prefix_caching"):
            raise ValueError(
                f"inflight_policy='keep' with prefix caching on at {self.url}: vLLM cannot reset the prefix "
                "cache while kept requests hold blocks, so new requests would reuse KV of the old weights; "
                "start vLLM with --no-enable-prefix-caching, or use 'recompute'"
            )
        self.draft = self._speculative_draft(server, config.draft)
        self.plan, self.inflight_policy, self._rendezvous = plan, config.inflight_policy, rendezvous
        if self.draft:  # a draft session hands every worker the draft model before it joins
            self._call("/start_draft_weight_update")
            self._call("/finish_weight_update")
        info = JoinInfo.of(rendezvous)
        timeout = config.timeout_s + 30
        return BackgroundCall(lambda: self._call("/init_weight_transfer_engine", body={"init_info": info.to_json()},
                                                 timeout_s=timeout), f"joining vLLM at {self.url}")

    def _speculative_draft(self, server: dict, draft: str) -> bool:
        """Return whether the server runs a draft model the sync updates (its MTP layers); raise ValueError
        naming the fix for a draft it would leave on its start-up weights."""
        speculative = server.get("speculative_config") or {}
        if speculative.get("draft_model_config") is None:
            return False  # no draft model (none, or n-gram lookup)
        method = speculative.get("method")
        if method != "mtp":
            raise ValueError(f"vLLM at {self.url} runs a speculative draft model ({method}) that is not the served "
                             "model's own draft (MTP) layers: the trainer does not train it, so it would keep its "
                             "start-up weights. Serve without --speculative-config, or with "
                             "'{\"method\": \"mtp\", ...}'")
        if draft != "sync":
            raise ValueError(f"vLLM at {self.url} runs an MTP draft, but weight_sync.draft is {draft!r}: the draft "
                             "would keep its start-up weights. Set weight_sync.draft: sync (or serve without "
                             "--speculative-config)")
        return True

    # -- around each sync ------------------------------------------------------------------------

    def before_sync(self, version: int) -> None:
        """Pause per the policy ("wait" blocks until requests in flight finish) and open the update."""
        self._require_joined()
        self._call("/pause", query={"mode": self.plan.mode, "clear_cache": False}, timeout_s=self.drain_timeout_s)
        self._call("/start_weight_update")

    def begin_transfer(self, version: int) -> None:
        """POST /update_weights on a thread: it returns once every worker received and agreed (with a draft:
        the target session's, then the draft session's, which commits both)."""
        body = {"update_info": UpdateInfo(version=version).to_json()}
        timeout = self._require_joined().config.timeout_s * 3 + 60

        def update() -> None:
            self._call("/update_weights", body=body, timeout_s=timeout)
            if self.draft:
                self._call("/finish_weight_update")  # the target's session; the version commits in the draft's
                self._call("/start_draft_weight_update")
                self._call("/update_weights", body=body, timeout_s=timeout)

        self._update = BackgroundCall(update, f"/update_weights of version {version} at {self.url}")

    def after_sync(self, version: int, ok: bool) -> None:
        """Close the update, tag and reset the cache only on `ok`, and always resume generation.

        After a failed sync the workers already hold the previous weights
        again; closing the session changes nothing and the tag stays.
        """
        update_error = self._wait_update(version)
        try:
            if update_error is None:  # a failed call already ended vLLM's session
                tag = {"weight_version": str(version)} if ok else {}
                self._call("/finish_weight_update", body=tag)
                if ok:
                    self._reset_prefix_cache()
        finally:
            self._call("/resume")
        if update_error is not None:
            raise update_error

    def _wait_update(self, version: int) -> Optional[Exception]:
        """Return the /update_weights call's error (None when it returned)."""
        update, self._update = self._update, None
        if update is None:
            return None
        try:
            update.wait(self._require_joined().config.timeout_s * 3 + 90)
        except EngineHTTPError as e:
            return e
        except TimeoutError as e:
            return EngineHTTPError(self.url, "/update_weights", f"of version {version}: {e}")
        return None

    def _reset_prefix_cache(self) -> None:
        if self.plan.reset_running is None:
            return  # "keep": checked at start-up that the server caches no prefixes
        answer = self._call("/reset_prefix_cache", query={"reset_running_requests": self.plan.reset_running})
        if not (answer or {}).get("success"):
            raise EngineHTTPError(self.url, "/reset_prefix_cache",
                                  f"refused (blocks still held under policy {self.inflight_policy!r}): {answer}")

    def describe_rank(self, inference_rank: int) -> Optional[str]:
        """Return "vLLM worker w of <url>" when `inference_rank` is one of this server's workers."""
        worker = None if self._rendezvous is None else self._rendezvous.worker_of(inference_rank)
        return None if worker is None else f"vLLM worker {worker} of {self.url}"

    def close(self) -> None:
        """Let the workers leave the transport group (they keep serving the current weights)."""
        if self._rendezvous is not None:
            self._call("/shutdown_weight_transfer_engine")
            self._rendezvous = None

    # -- reading what the server reports ------------------------------------------------------------

    def weight_version(self) -> str:
        """Return the weight version the server reports (GET /weight_info)."""
        return self._call("/weight_info", method="GET")["weight_version"]

    def _require_joined(self) -> Rendezvous:
        if self._rendezvous is None:
            raise RuntimeError(f"vLLM at {self.url} has not joined a transport group; call join() first")
        return self._rendezvous

    def token_logprobs(self, tokens: list[int]) -> list[float]:
        """Return the served model's log p(token i + 1 | tokens 0..i) for `tokens` (the canary), through
        /v1/completions' prompt log-probabilities."""
        model = self._call("/v1/models", method="GET")["data"][0]["id"]
        answer = self._call("/v1/completions", body={"model": model, "prompt": list(tokens), "max_tokens": 1,
                                                     "temperature": 0.0, "prompt_logprobs": 0})
        per_position = answer["choices"][0]["prompt_logprobs"]
        return [float(per_position[i][str(token)]["logprob"]) for i, token in enumerate(tokens) if i > 0]

    def _call(self, route: str, *, method: str = "POST", body: Any = None, query: Optional[dict] = None,
              timeout_s: Optional[float] = None) -> Any:
        return request_json(self.url, route, method=method, body=body, query=query,
                            timeout_s=self.timeout_s if timeout_s is None else timeout_s)
