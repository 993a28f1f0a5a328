"""Transport "sglang": the trainer's stage sources feed SGLang servers through SGLang's own update API.

Only the trainer runs megatron-sync code; SGLang's ranks receive with their
own. Transport ranks 0..P-1 are the trainer's stage sources, P.. the servers'
ranks (`weight_sync.engines`: "sglang=http://host:port", in order). Rank 0
talks to every server: its own stage's buckets and, received from the later
stages' sources (`stages.py`), theirs, one bucket at a time and in plan order,
by the delivery `weight_sync.sglang_load` chooses (`delivery.py`): over
update groups ("distributed", one per server) or in shared memory ("tensor",
servers on the trainer's host). The sender, its host replica and the plan are the generic
bucket ones (`transports.buckets`), without checksums (SGLang checks none).

Nothing half-applied. SGLang loads each bucket into the live weights as it
arrives, and its begin/end update session stages nothing (in 0.5.23 it only
re-packs weights some quantization methods keep packed). So rank 0 keeps a
host copy of every bucket of the last version every server took whole, and
of the version under way. When a sync fails anywhere (a stage's sender, a
server refusing a bucket or dying, a broken group), before the failure is
raised rank 0 sends that previous version again, whole, to every server
still answering (after rebuilding the update groups that broke); if
no version was synced yet, a server that still reports its start version
("default") reloads the checkpoint it started from (/update_weights_from_disk
with its own model path); one that was updated by someone else cannot be
restored by this trainer. A server that
cannot be restored is tagged "partial-vN" and stays paused
(`SGLangEngineClient.after_sync`). The cost: two host copies of the
inference-format model on rank 0's host, and a failed sync costs a resend.

A fleet of servers (`fleet.enabled`; the servers' membership is kept by
`fleet.servers.ServerFleet` on the trainer's leader, which tells rank 0 who
takes part, `take_part`). A server that refuses a bucket, whose ranks
disagree, or that dies fails only itself: no more buckets go to it, and when
at least `fleet.min_engines` servers took the version whole it commits on
them, while rank 0 gives a failed server that still answers the previous
version again (`restore`) and drops one that does not answer from the
delivery. `outcomes` then says, per server, what happened; `rejoin` forms a
new update group with a server that answers again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from megatron_sync.core.agreement import describe
from megatron_sync.core.errors import AgreedFailure
from megatron_sync.core.meta import TensorMeta
from megatron_sync.engines.http import EngineHTTPError
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.session.control import ControlChannel, ControlMessage, Report
from megatron_sync.settings.config import parse_engine
from megatron_sync.transports.base import BucketHeader, Commit, PendingBucket, Receiver
from megatron_sync.transports.buckets.transport import PlanBucketTransport
from megatron_sync.transports.sglang.delivery import Delivered, GroupDelivery, TensorDelivery
from megatron_sync.transports.sglang.group import UpdateGroup, host_store, join_store, release
from megatron_sync.transports.sglang.restore import Versions, answers, restore
from megatron_sync.transports.sglang.stages import receive_from_stage, send_to_leader, stage_group
from megatron_sync.transports.sglang.verify import ranks_disagree, replicated_params

if TYPE_CHECKING:
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.plan.buckets import KeepTogether
    from megatron_sync.settings.config import WeightSyncConfig



COMMITTED, RESTORED, PARTIAL, LEFT = "committed", "restored", "partial", "left"
"""A server's outcome of a version (`SGLangTransport.outcomes`): it took the version whole; it was given the
previous version again; it could not be (tagged partial, paused); it stopped answering."""


class HTTPOnlyControl(ControlChannel):
    """SGLang's ranks follow HTTP calls, not control messages: nothing is sent and no report comes back."""

    def send(self, message: ControlMessage) -> None:
        """Nothing to send: the engine clients drive SGLang over HTTP."""

    def next(self, timeout_s: float) -> ControlMessage:
        raise NotImplementedError("transport 'sglang' has no inference endpoint that reads control messages")

    def report(self, kind: Report, version: int, rank: int, payload: bytes) -> None:
        raise NotImplementedError("transport 'sglang' has no inference endpoint that reports")

    def collect(self, kind: Report, version: int, ranks: Iterable[int],
                timeout_s: Optional[float] = None) -> dict[int, bytes]:
        """Return {}: SGLang reports nothing through the store (its answers come over HTTP)."""
        return {}


class _Done:
    """A bucket with nothing (more) to wait for here."""

    done_at: Optional[float] = None

    def wait(self) -> None:
        """Nothing to wait for."""

    def is_completed(self) -> bool:
        return True


class _Forwarded(PendingBucket):
    """A bucket rank 0 hands on to the servers; its refusals are recorded for the next agreement."""

    def __init__(self, delivered: Optional[Delivered], transport: "SGLangTransport",
                 header: Optional[BucketHeader] = None, data: Optional[torch.Tensor] = None) -> None:
        self._delivered, self._transport, self._header, self._data = delivered, transport, header, data

    def wait(self) -> Any:
        if self._delivered is not None:
            delivered, self._delivered = self._delivered, None  # its refusals are noted once
            self._transport.note_refusals(delivered.wait())
        return self._header, self._data

    def is_completed(self) -> bool:
        return self._delivered is None or self._delivered.is_completed()

    @property
    def done_at(self) -> Optional[float]:
        return None if self._delivered is None else self._delivered.done_at


class SGLangTransport(PlanBucketTransport):
    """Stage source `rank` of the trainer's side of SGLang's update API (rank 0 talks to the servers)."""

    name = "sglang"
    keeps_server_fleet = True  # with fleet.enabled, rank 0 sends to the servers `fleet.servers.ServerFleet` keeps
    max_buckets_in_flight = 1  # a server takes the buckets one after another, each announced then broadcast
    meets_at_store = False  # the servers join SGLang's update group at master_address:master_port

    def __init__(self, *, stage: int, num_stages: int, num_inference_ranks: int, store: Any,
                 stages: Any = None, delivery: Any = None, replicated: Optional[dict[str, frozenset]] = None,
                 fleet_min: Optional[int] = None) -> None:
        self.rank, self.num_stages = stage, num_stages
        self.world_size = num_stages + num_inference_ranks
        self.control = HTTPOnlyControl()
        self._store, self._stages, self.delivery = store, stages, delivery
        self._versions = Versions()
        self._replicated = replicated or {}  # multi-rank servers: params every TP rank holds whole
        self._failures: list[str] = []
        self._gone: set[str] = set()  # servers that stopped answering: rank 0 sends them nothing more
        self._fleet_min = fleet_min  # a fleet: how many servers must take a version whole (None: every one)
        self._server_failures: dict[str, str] = {}  # a fleet: the servers that failed the version under way
        self.outcomes: dict[str, tuple[str, str]] = {}  # after each version: URL -> (outcome, what failed)
        self._last: Optional[_Forwarded] = None
        self._lock = threading.Lock()

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Any = None) -> "SGLangTransport":
        """Return stage source `layout.pp_rank`'s endpoint; rank 0 hosts the store and (distributed) forms
        an update group with each server (collective over the stage sources and the servers' ranks)."""
        urls = [url for kind, url in map(parse_engine, config.engines) if kind == "sglang"]
        if not urls or len(urls) != len(config.engines):
            raise ValueError("transport 'sglang' sends to SGLang servers only: list them in weight_sync.engines "
                             f"as 'sglang=http://host:port' (got {list(config.engines)})")
        backend = config.resolved_backend(torch.cuda.is_available())
        where, timeout = (config.master_address, config.master_port), config.timeout_s
        delivery, replicated = None, {}
        if layout.pp_rank == 0:
            store = host_store(*where, timeout)
            tp_sizes = [int(call_sglang(url, "/server_info", method="GET", timeout_s=timeout)["tp_size"])
                        for url in urls]
            if config.sglang_load == "tensor":
                delivery = TensorDelivery(urls, tp_sizes, timeout)
            else:
                groups = [UpdateGroup(store, url, tp, i, master_address=where[0], master_port=where[1],
                                      backend=backend, timeout_s=timeout, http_timeout_s=timeout)
                          for i, (url, tp) in enumerate(zip(urls, tp_sizes))]
                for group in groups:
                    group.form()
                delivery = GroupDelivery(groups, timeout)
            replicated = {url: replicated_params(url, timeout) for url, tp in zip(urls, tp_sizes) if tp > 1}
        else:
            store = join_store(*where, timeout)
        stages = stage_group(store, layout.pp, layout.pp_rank, port=config.master_port, backend=backend,
                             timeout_s=timeout) if layout.pp > 1 else None
        return cls(stage=layout.pp_rank, num_stages=layout.pp, num_inference_ranks=config.num_inference_ranks,
                   store=store, stages=stages, delivery=delivery, replicated=replicated,
                   fleet_min=config.min_engines if config.fleet else None)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int,
                          inference_rank: int, session: Any = None) -> "SGLangTransport":
        raise ValueError("transport 'sglang' has no megatron-sync inference ranks: SGLang's own ranks receive, "
                         "driven over HTTP by the trainer (weight_sync.engines)")

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional[Commit] = None) -> Receiver:
        raise ValueError("transport 'sglang' has no megatron-sync receiver: SGLang receives with its own code")

    @classmethod
    def make_sender(cls, transport, stream, config: "WeightSyncConfig", keep_together: "KeepTogether"):
        """The bucket sender, without checksums: SGLang verifies none."""
        return super().make_sender(transport, stream, config.replace(checksum="none"), keep_together)

    @property
    def device(self) -> torch.device:
        if isinstance(self.delivery, GroupDelivery):
            return self.delivery.device
        return self._stages.device if self._stages is not None else torch.device("cpu")

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return every stage's metadata (SGLang takes no part in the plan handshake)."""
        assert stage_metas is not None, "every rank of this transport is a stage source"
        wires = self.all_gather_json([list(m.to_wire()) for m in stage_metas])
        return [[TensorMeta.from_wire(tuple(w)) for w in stage] for stage in wires]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every stage source's `obj` (SGLang's ranks never join these)."""
        return [obj] if self._stages is None else self._stages.all_gather_json(obj)

    # ---- moving buckets ----

    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor, seal: Callable[[], BucketHeader]) -> Any:
        """Rank 0: hand this stage's bucket on to the servers; a later stage: send it to rank 0."""
        header = seal()  # no checksum (SGLang checks none); it says whether the sender aborted
        if self.rank != 0:
            return send_to_leader(self._stages, bucket, data, header)
        if header.nbytes < 0:  # the sender failed before filling it: announce nothing, SGLang would load it
            return _Done()
        return self._forward(bucket, data[: bucket.nbytes])

    def recv_bucket(self, bucket: BucketPlan, out: Optional[torch.Tensor]) -> PendingBucket:
        """Rank 0: receive a later stage's bucket and hand it on; other stages take no part in it."""
        if self.rank != 0:
            return _Forwarded(None, self)
        header = receive_from_stage(self._stages, bucket, out)
        if header.nbytes < 0:  # its stage failed; the agreement says so
            return _Forwarded(None, self, header, out)
        forwarded = self._forward(bucket, out[: bucket.nbytes])
        forwarded._header, forwarded._data = header, out
        return forwarded

    def _forward(self, bucket: BucketPlan, payload: torch.Tensor) -> _Forwarded:
        """Deliver one bucket after the previous one finished (SGLang pairs announcements with broadcasts
        in arrival order); nothing more moves once this sync failed (the agreement restores the servers)."""
        self._finish_last()
        kept = self._versions.keep(bucket, payload)
        with self._lock:
            failed = bool(self._failures)
        if failed:
            return _Forwarded(None, self)
        self._last = _Forwarded(self.delivery.deliver(bucket, kept, self._targets()), self)
        return self._last

    def _finish_last(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.wait()

    def _members(self) -> list[str]:
        return [url for url in self.delivery.urls if url not in self._gone]

    def _targets(self) -> list[str]:
        with self._lock:
            return [url for url in self._members() if url not in self._server_failures]

    def note_refusals(self, refusals: dict[str, str]) -> None:
        """Keep the servers' refusals of a bucket for the next agreement (in a fleet: that server's failure)."""
        with self._lock:
            for url, message in refusals.items():
                if self._fleet_min is not None:
                    self._server_failures.setdefault(url, message)
                else:
                    self._failures.append(f"SGLang at {url}: {message}")

    # ---- a fleet of servers (rank 0; `fleet.servers.ServerFleet` decides) ----

    def take_part(self, urls: list[str]) -> None:
        """Send the next version to the servers at `urls` only (the others left the fleet)."""
        self._gone = set(self.delivery.urls) - set(urls)

    def rejoin(self, url: str) -> None:
        """Make the server at `url`, which left and answers again, a target: a new update group is formed with
        its ranks (raises, naming the server, when it cannot take part). A server that does not answer within
        seconds is asked again at the next sync: a host that swallows connections costs a boundary that
        long, not timeout_s."""
        if not answers(url):
            raise EngineHTTPError(url, "/server_info", "no answer within seconds")
        info = call_sglang(url, "/server_info", method="GET", timeout_s=self.delivery.timeout_s)
        tp = int(info["tp_size"])
        self.delivery.rejoin(url, tp)
        self._replicated.pop(url, None)
        if tp > 1:
            self._replicated[url] = replicated_params(url, self.delivery.timeout_s)
        self._gone.discard(url)

    # ---- agreeing, restoring ----

    def agree(self, error: Optional[str], *, what: str,
              failure: Optional[Callable[[list[tuple[int, str]]], AgreedFailure]] = None) -> None:
        """Raise on every stage source if any failed or a server refused a bucket since the last call; rank 0
        first restores every server still answering to the previous version."""
        mine = [error] if error is not None else []
        if self.rank == 0:
            try:
                self._finish_last()
            except Exception as e:  # noqa: BLE001 — agreed on below, with its cause
                mine.append(f"the last bucket: {describe(e, limit=3)}")
            with self._lock:
                mine, self._failures = mine + self._failures, []
            if not mine and self._versions.current:  # every bucket went out: did every TP rank apply them?
                disagree = self._ranks_not_applied()
                if self._fleet_min is None:
                    mine = [f"SGLang at {url}: {problem}" for url, problem in disagree.items()]
                else:
                    self.note_refusals(disagree)
                    mine = self._too_few_took_it()
        failures = [(rank, message) for rank, messages in enumerate(self.all_gather_json(mine))
                    for message in messages]
        if self.rank == 0:
            if failures:
                failures += [(0, m) for m in self._restore_previous()]
            elif self._versions.current:
                self._settle_fleet()
                self._versions.commit()
        if failures:
            raise failure(failures) if failure is not None else AgreedFailure(what, failures)

    def _ranks_not_applied(self) -> dict[str, str]:
        """Return, per multi-rank server taking part, why one of its TP ranks did not apply what rank 0 loaded."""
        problems = {}
        for url in self._targets():
            if url not in self._replicated:
                continue
            try:
                problem = ranks_disagree(url, self._replicated[url], self.delivery.timeout_s)
            except EngineHTTPError as e:
                problem = f"its ranks' weight digests could not be read: {e}"
            if problem is not None:
                problems[url] = problem
        return problems

    def _too_few_took_it(self) -> list[str]:
        """A fleet: the failure to agree on when fewer than `fleet_min` servers took the version whole."""
        took = self._targets()
        if len(took) >= self._fleet_min:
            return []
        with self._lock:
            failed = "; ".join(f"SGLang at {url}: {message}" for url, message in self._server_failures.items())
        return [f"only {len(took)} SGLang server(s) took the version whole, fewer than weight_sync.fleet."
                f"min_engines={self._fleet_min} ({failed or 'none serves'})"]

    def _settle_fleet(self) -> None:
        """A fleet whose version went through: give each server that failed it the previous version again if it
        still answers (it stays on that version), drop it from the delivery if not; record every outcome."""
        with self._lock:
            failed, self._server_failures = self._server_failures, {}
        self.outcomes = {url: (COMMITTED, "") for url in self._members() if url not in failed}
        if not failed:
            return
        alive = [url for url in failed if answers(url)]
        dead = [url for url in failed if url not in alive]
        self._gone.update(dead)
        problems = restore(self.delivery, self._versions.previous, alive, dead) if alive else []
        if dead and not alive:
            self.delivery.recover(dead)
        for url in dead:
            self.outcomes[url] = (LEFT, f"{failed[url]}; it stopped answering")
        for url in alive:
            undone = next((p for p in problems if url in p), None)
            self.outcomes[url] = (PARTIAL if undone else RESTORED, f"{failed[url]}; {undone or 'restored'}")

    def _restore_previous(self) -> list[str]:
        """Send the previous version again to every server still answering; return what could not be restored."""
        self._versions.current = {}
        with self._lock:
            failed, self._server_failures = self._server_failures, {}
        members = self._members()
        alive = [url for url in members if answers(url)]
        dead = [url for url in members if url not in alive]
        self._gone.update(dead)
        problems = [f"SGLang at {url} stopped answering; it keeps whatever it had loaded" for url in self._gone]
        undone = restore(self.delivery, self._versions.previous, alive, dead)
        self.outcomes = {url: (LEFT, failed.get(url, "it stopped answering")) for url in dead}
        for url in alive:
            problem = next((p for p in undone if url in p), None)
            self.outcomes[url] = (PARTIAL if problem else RESTORED, problem or failed.get(url, "the sync failed"))
        return problems + undone

    def close(self) -> None:
        """Rank 0: the servers leave their update groups; every stage source releases its groups and store."""
        if self.delivery is not None:
            self.delivery.close()
            self.delivery = None
        if self._stages is not None:
            release(self._stages)
            self._stages = None
        self._store = None
