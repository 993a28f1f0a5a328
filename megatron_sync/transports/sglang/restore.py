"""How rank 0 undoes a failed sync on the SGLang servers: its host copies of every bucket, sent again.

SGLang loads each bucket into the live weights as it arrives (its update
session stages nothing), so a sync that fails midway has changed part of
every server that took part. Rank 0 keeps a host copy of every bucket of the
last version every server took whole (`Versions`) and `restore` sends it
again, whole, inside an update session, to every server still answering, once
the delivery is usable again (the update group rebuilt without the others).
Before any version went through, a server that still reports its start
version ("default") reloads the checkpoint it started from instead. A server
that cannot be restored is tagged `requests.PARTIAL` (its client keeps it
paused).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.engines.http import EngineHTTPError
from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.plan.buckets import BucketPlan

log = logging.getLogger("megatron_sync")
START_VERSION = "default"
"""The weight version SGLang reports until its first tagged update (its --weight-version default)."""


class Versions:
    """Rank 0's host copies of every bucket: of the last version the servers took whole, and of this one."""

    def __init__(self) -> None:
        self.previous: Optional[list[tuple[BucketPlan, torch.Tensor]]] = None
        self.current: dict[int, tuple[BucketPlan, torch.Tensor]] = {}

    def keep(self, bucket: BucketPlan, payload: torch.Tensor) -> torch.Tensor:
        """Return a host copy of `payload` kept as `bucket` of the version under way."""
        kept = payload.to("cpu", copy=True)
        self.current[bucket.index] = (bucket, kept)
        return kept

    def commit(self) -> None:
        """The version under way went through everywhere: it is what a later failure restores."""
        if self.current:
            self.previous = [self.current[i] for i in sorted(self.current)]
        self.current = {}


def restore(delivery: Any, previous: Optional[list[tuple[BucketPlan, torch.Tensor]]],
            alive: Sequence[str], dead: Sequence[str] = ()) -> list[str]:
    """Bring the servers at `alive` back to `previous` (None: their start checkpoints) once the `dead` ones are
    dropped from the delivery; return the failures."""
    try:
        delivery.recover(dead)
        _reopen_sessions(alive, delivery.timeout_s)
        if previous is None:
            refused = _reload_start_checkpoints(list(alive), delivery.timeout_s)
        else:
            refused = {}
            for bucket, kept in previous:
                refused.update(delivery.deliver(bucket, kept, [u for u in alive if u not in refused]).wait())
    except Exception as e:  # noqa: BLE001 — reported with the sync's failure
        refused = {url: describe(e, limit=3) for url in alive}
    for url in refused:
        _tag_partial(url, delivery.timeout_s)
    if alive and not refused:
        log.warning("transport sglang: the failed sync was undone on %s (previous version sent again)", list(alive))
    return [f"restoring the previous version on {url} failed ({message}); it stays paused"
            for url, message in refused.items()]


def answers(url: str) -> bool:
    """True when the server answers /server_info within seconds."""
    try:
        call_sglang(url, "/server_info", method="GET", timeout_s=10)
        return True
    except EngineHTTPError:
        return False


def _reopen_sessions(urls: list[str], timeout_s: float) -> None:
    """Make sure each server has an update session open (someone may have closed it: that is what failed)."""
    for url in urls:
        try:
            call_sglang(url, "/begin_weight_update", body=requests.begin_weight_update(), timeout_s=timeout_s)
        except EngineHTTPError as e:
            if "already open" not in str(e):
                raise


def _reload_start_checkpoints(urls: list[str], timeout_s: float) -> dict[str, str]:
    """Have each server that still holds the checkpoint it was started from (weight version "default":
    never tagged since) reload it; return the others, and the refusals, by URL."""
    refused = {}
    for url in urls:
        try:
            info = call_sglang(url, "/model_info", method="GET", timeout_s=timeout_s)
            if info["weight_version"] != START_VERSION:
                refused[url] = (f"it served weight version {info['weight_version']!r} before this trainer's first "
                                "sync, which this trainer does not hold")
                continue
            call_sglang(url, "/update_weights_from_disk", body={"model_path": info["model_path"],
                                                                "flush_cache": False}, timeout_s=timeout_s)
        except EngineHTTPError as e:
            refused[url] = str(e)
    return refused


def _tag_partial(url: str, timeout_s: float) -> None:
    try:
        call_sglang(url, "/update_weight_version", body=requests.update_weight_version(requests.PARTIAL),
                    timeout_s=timeout_s)
    except EngineHTTPError as e:
        log.error("SGLang at %s could not be tagged as partially updated: %s", url, e)
