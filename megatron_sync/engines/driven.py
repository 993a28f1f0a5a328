"""The engines a trainer drives over their own APIs (vLLM, SGLang): their joins and their per-sync hooks.

`TrainerWeightSync` holds one `EngineFleet`. On the leader it holds the
`EngineClient`s (passed as `engine_clients=`, or built from
`weight_sync.engines`, entries "KIND=URL"); on every other trainer rank it
holds none but knows whether engines are driven, so the agreement rounds
around the engines' hooks are collective on every trainer rank.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import import_module
from typing import Iterator, Optional, Sequence

import torch

from megatron_sync.settings.config import ENGINE_CLIENTS, WeightSyncConfig, parse_engine
from megatron_sync.engines.base import EngineClient, Joining, Rendezvous, plan_rendezvous
from megatron_sync.core.errors import SyncAbortedError

log = logging.getLogger("megatron_sync")

JOIN_GRACE_S = 60.0
"""How much longer than `timeout_s` a join may take: it returns only after the plan handshake."""


def clients_from_config(config: "WeightSyncConfig") -> list[EngineClient]:
    """Return one EngineClient per `config.engines` entry, in order (no request is sent yet)."""
    clients = []
    for entry in config.engines:
        kind, url = parse_engine(entry)
        module, name = ENGINE_CLIENTS[kind].split(":")
        clients.append(getattr(import_module(module), name)(url, timeout_s=config.timeout_s))
    return clients


def worker_counts(clients: Sequence[EngineClient]) -> list[int]:
    """Return each client's worker count, in order, asking every engine at once: a vLLM server's first
    answer about itself takes seconds (/server_info runs vLLM's environment report: `pip list` and more;
    1.6 s on an idle 2-core machine), so a fleet asked one by one would wait for the sum at start-up.
    A failing engine raises its own error; the first one in order is raised."""
    if len(clients) <= 1:
        return [client.num_workers() for client in clients]
    with ThreadPoolExecutor(max_workers=min(len(clients), 64), thread_name_prefix="megatron-sync-engine-query") as pool:
        asked = [pool.submit(client.num_workers) for client in clients]
        return [answer.result() for answer in asked]


class EngineFleet:
    """The driven engines of one trainer: joins them to the transport group and calls their sync hooks.

    `driven` must be the same on every trainer rank; `clients` are non-empty
    only on the leader, so every method is a no-op on the other ranks.
    """

    def __init__(self, clients: Sequence[EngineClient], *, driven: bool) -> None:
        self.clients, self.driven = list(clients), driven
        self._joins: list[Joining] = []
        self._join_timeout_s = 0.0
        self.joins_started = False  # some engine's workers were asked to join (they may be on their way)

    def start_joins(self, config: "WeightSyncConfig", num_trainer_stages: int) -> list[Rendezvous]:
        """Start every engine joining the transport group (each checks first that it can); return their
        rendezvous. The joins complete while the trainer connects (`joined`)."""
        if not self.clients:
            return []
        counts = worker_counts(self.clients)
        backend = config.resolved_backend(torch.cuda.is_available())
        rendezvous = plan_rendezvous(config, num_trainer_stages, counts, backend)
        self._join_timeout_s = config.timeout_s + JOIN_GRACE_S
        for client, r in zip(self.clients, rendezvous):
            self._joins.append(client.join(r))
            self.joins_started = True
        return rendezvous

    @contextmanager
    def joined(self) -> Iterator[None]:
        """Run the trainer's connect in the block; afterwards wait for every join (raise the first failure).

        When the block raises, the joins fail too (the group never forms);
        they are waited for and logged, and the block's error is raised.
        """
        joins, self._joins = self._joins, []
        try:
            yield
        except BaseException:
            for join in joins:
                try:
                    join.wait(self._join_timeout_s)
                except Exception as e:  # noqa: BLE001 — the connect error is the cause
                    log.warning("an engine's join failed as the trainer's connect did: %s", e)
            raise
        for join in joins:
            join.wait(self._join_timeout_s)

    def before_sync(self, version: int) -> None:
        """Pause every engine and open its update; if one fails, resume those already paused, then raise."""
        opened: list[EngineClient] = []
        try:
            for client in self.clients:
                client.before_sync(version)
                opened.append(client)
        except Exception:
            self._after_sync(opened, version, ok=False)
            raise

    def begin_transfer(self, version: int) -> None:
        """Start every engine's receive of `version` (after every engine paused)."""
        for client in self.clients:
            client.begin_transfer(version)

    def after_sync(self, version: int, ok: bool) -> None:
        """Close every engine's update and resume it; raise the first error (only when `ok`) after all."""
        self._after_sync(self.clients, version, ok)

    def _after_sync(self, clients: Sequence[EngineClient], version: int, ok: bool) -> None:
        errors = []
        for client in clients:
            try:
                client.after_sync(version, ok)
            except Exception as e:  # noqa: BLE001 — every engine must be resumed before anything is raised
                errors.append(e)
                log.error("engine %s: closing the update of version %d failed: %s", client.url, version, e)
        if errors and ok:
            raise errors[0]

    def named(self, error: SyncAbortedError, inference_ranks: Optional[range]) -> SyncAbortedError:
        """Return `error` with each failing inference rank named by its engine ("vLLM worker 1 of URL: ...");
        `inference_ranks`: the transport ranks of the inference side (None: no transport here)."""
        if not self.clients or inference_ranks is None:
            return error
        failures = [(rank, self._name(rank, inference_ranks, message)) for rank, message in error.failures]
        if failures == error.failures:
            return error
        return SyncAbortedError(error.version, failures)

    def _name(self, rank: int, inference_ranks: range, message: str) -> str:
        if rank not in inference_ranks:
            return message
        for client in self.clients:
            where = client.describe_rank(rank - inference_ranks.start)
            if where is not None:
                return f"{where}: {message}"
        return message

    def close(self) -> None:
        """Let every engine's workers leave the transport group (errors are logged, not raised)."""
        for client in self.clients:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 — the trainer's own transport must still close
                log.warning("engine %s did not leave the transport group cleanly: %s", client.url, e)
        self.clients = []

