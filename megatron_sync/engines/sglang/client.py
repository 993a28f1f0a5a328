"""The trainer's HTTP client for an SGLang server (0.5.23), an `EngineClient` (no SGLang import).

The servers' ranks join SGLang's update group through transport "sglang"
(`megatron_sync.transports.sglang`), which owns the group: it forms it at
start-up and rebuilds it after a failure. Around each sync this client calls
/pause_generation {mode} -> /begin_weight_update (0.5.23 refuses tensor and
distributed updates outside such a session, with HTTP 400); the transport
then sends the buckets; after the last one /end_weight_update -> /flush_cache
(as the policy requires) -> /update_weight_version -> /continue_generation.
SGLang reports the version on every response (`meta_info.weight_version`)
and on /model_info. After a failed sync the transport has sent the previous
version again; the client closes the session and resumes, unless the
transport tagged the server "partial" (it could not be restored): that one
stays paused.

In-flight policies (`PAUSE_PLANS`): abort -> "abort" + flush; recompute ->
"retract" (running requests go back to the queue, their KV freed) + flush;
keep -> "in_place" (requests continue over old KV); SGLang cannot flush while
they hold the cache, so keep requires --disable-radix-cache. SGLang has no
mode that lets requests finish first ("wait").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from megatron_sync.engines.base import Rendezvous
from megatron_sync.engines.http import EngineHTTPError, request_json
from megatron_sync.engines.sglang import requests

log = logging.getLogger("megatron_sync")


@dataclass(frozen=True)
class SGLangPause:
    """How one in-flight policy pauses SGLang and whether the radix cache is flushed after the update."""

    mode: str
    flush: bool


PAUSE_PLANS = {
    "abort": SGLangPause("abort", flush=True),
    "recompute": SGLangPause("retract", flush=True),
    "keep": SGLangPause("in_place", flush=False),
}


class SGLangEngineClient:
    """One SGLang server (its TP ranks) driven over HTTP around each sync; an `EngineClient`."""

    def __init__(self, url: str, *, timeout_s: float = 300.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.inflight_policy: Optional[str] = None
        self.plan: Optional[SGLangPause] = None
        self._rendezvous: Optional[Rendezvous] = None
        self._info: Optional[dict] = None
        self.partially_updated = False

    def num_workers(self) -> int:
        """Return the server's TP size (its ranks in the update group); check it can take part."""
        if self._info is None:
            info = self._call("/server_info", method="GET")
            if info.get("dp_size", 1) != 1 or info.get("pp_size", 1) != 1:
                raise ValueError(f"SGLang at {self.url} runs dp_size={info.get('dp_size')} pp_size="
                                 f"{info.get('pp_size')}; its distributed weight update needs both 1")
            self._info = info
        return int(self._info["tp_size"])

    def join(self, rendezvous: Rendezvous) -> "_Joined":
        """Check the settings work with this server; the transport's rank 0 makes its ranks join.

        Raises ValueError, naming the fix, when they cannot: another transport
        than "sglang", a policy SGLang lacks ("wait"), "keep" while SGLang
        caches prefixes, or a dtype other than the server's.
        """
        config = rendezvous.config
        if config.transport != "sglang":
            raise ValueError(f"SGLang at {self.url} receives only through its own update API: set "
                             "weight_sync.transport: sglang")
        if config.inflight_policy not in PAUSE_PLANS:
            raise ValueError(f"inflight_policy={config.inflight_policy!r} is not available with SGLang; use one "
                             f"of {list(PAUSE_PLANS)} (SGLang's pause modes have no 'wait')")
        plan = PAUSE_PLANS[config.inflight_policy]
        if not plan.flush and not (self._info or {}).get("disable_radix_cache"):
            raise ValueError(f"inflight_policy='keep' at {self.url}: SGLang cannot flush its radix cache "
                             "while kept requests run; start it with --disable-radix-cache or use 'recompute'")
        served = (self._info or {}).get("dtype")
        if served not in (None, "auto", config.dtype):
            raise ValueError(f"SGLang at {self.url} serves --dtype {served} but weight_sync.dtype={config.dtype!r}; "
                             f"start it with --dtype {config.dtype} or set weight_sync.dtype: {served}")
        self.plan, self.inflight_policy, self._rendezvous = plan, config.inflight_policy, rendezvous
        return _Joined()

    def before_sync(self, version: int) -> None:
        """Pause per the policy and open SGLang's update session."""
        self._call("/pause_generation", body=requests.pause_generation(self.plan.mode))
        self._call("/begin_weight_update", body=requests.begin_weight_update())

    def begin_transfer(self, version: int) -> None:
        """Nothing to start: the transport announces each bucket as it sends it."""

    def after_sync(self, version: int, ok: bool, *, holds: Optional[int] = None) -> None:
        """Close the session; on `ok` flush, tag and resume; after a failure resume on the previous version,
        unless the transport could not restore it (tagged "partial"): then stay paused. `holds`: after a
        failure, the version the transport restored (tagged before resuming; None: the tag stays)."""
        self._call("/end_weight_update", body=requests.end_weight_update())
        if not ok:
            self.partially_updated = self.weight_version() == requests.PARTIAL
            if self.partially_updated:
                log.error("SGLang at %s holds part of version %d and stays paused; the next successful sync "
                          "resumes it", self.url, version)
                return
            if holds is not None:  # restored to another version than it served before (it rejoined a fleet)
                if self.plan.flush:
                    request_json(self.url, "/flush_cache", timeout_s=self.timeout_s, text=True)
                self._call("/update_weight_version", body=requests.update_weight_version(holds))
            self._call("/continue_generation", body=requests.continue_generation())
            return
        if self.plan.flush:  # at once, while still paused: SGLang then ignores the requests "retract" queued
            request_json(self.url, "/flush_cache", timeout_s=self.timeout_s, text=True)
        self._call("/update_weight_version", body=requests.update_weight_version(version))
        self._call("/continue_generation", body=requests.continue_generation())
        self.partially_updated = False

    def describe_rank(self, inference_rank: int) -> Optional[str]:
        """Return "SGLang TP rank t of <url>" when `inference_rank` is one of this server's ranks."""
        worker = None if self._rendezvous is None else self._rendezvous.worker_of(inference_rank)
        return None if worker is None else f"SGLang TP rank {worker} of {self.url}"

    def close(self) -> None:
        """Nothing to leave here: the transport has the server's ranks leave its update group."""
        self._rendezvous = None

    def weight_version(self) -> str:
        """Return the weight version the server reports (GET /model_info)."""
        return self._call("/model_info", method="GET")["weight_version"]

    def _call(self, route: str, *, method: str = "POST", body: Any = None, query: Optional[dict] = None,
              timeout_s: Optional[float] = None) -> Any:
        return call_sglang(self.url, route, method=method, body=body, query=query,
                           timeout_s=self.timeout_s if timeout_s is None else timeout_s)


class _Joined:
    """The server's part at start-up is done when the transport's rank 0 formed the group with it."""

    def wait(self, timeout_s: float) -> None:
        """Nothing left to wait for here."""


def call_sglang(url: str, route: str, *, timeout_s: float, method: str = "POST", body: Any = None,
                query: Optional[dict] = None) -> Any:
    """Return SGLang's JSON answer; raise EngineHTTPError also when it answers {"success": false}."""
    answer = request_json(url, route, method=method, body=body, query=query, timeout_s=timeout_s)
    if isinstance(answer, dict) and answer.get("success") is False:
        raise EngineHTTPError(url, route, f"reported failure: {answer.get('message')}")
    return answer
