"""The join handshake of a sync session, as data and pure decisions (the network part: `session.py`).

A sync session is one trainer job and one inference job meeting at
`weight_sync.master_address:master_port`. The trainer's first joining rank
hosts it and names it (`weight_sync.run_id`, or a generated id). Every other
rank that takes part presents an `Identity`: its job, its role, its index among
its role's ranks, and what it assumes of the other side (`EXPECTATIONS`, and
the model-defining fields of its HF config). The host answers each with an
`Admission.decide` decision: accepted, or a refusal that names both values.

A refusal is *fatal* to the session (the host fails too, quoting it) when it
comes from the only job that could complete the session: the first job of its
role, or a rank of the job already accepted. A second job pointed at the same
address is refused and the session goes on undisturbed.

With a session secret (`secret.py`) the host presents a keyed digest of its
session, every joiner one of its identity; a joiner without one, or with
another secret's, is refused by name before anything else is looked at, and
the session goes on undisturbed. In a fleet, a new job presenting the engine
id of a job whose ranks still answer (`contested`, asked over the network by
the host) is refused; once that job is gone, the new one supersedes it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

from megatron_sync.convert.model_digest import model_differences
from megatron_sync.session.secret import SECRET_ENV, SessionSecret, new_nonce

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig


@dataclass(frozen=True)
class Expectation:
    """One setting both jobs must share; `says` words a disagreement, host's value first.

    `value(config, trainer_stages, backend)` reads it off a job's settings (None: it does not apply to
    that job, e.g. a Mooncake protocol under the torch mover, and is not compared); rows without one
    are stated by the caller (a bare group's world size)."""

    key: str
    says: str  # "{host} ... {h} ..., this {joiner} job ... {j}"
    fix: str  # where an operator sets it
    value: Optional[Callable[["WeightSyncConfig", int, str], Any]] = None
    adoptable: bool = False  # a joiner that says "auto" takes the host's value (transport: auto)


def _checksum(config: "WeightSyncConfig", trainer_stages: int, backend: str) -> str:
    import torch

    from megatron_sync.core.checksum import resolve_checksum  # what "auto" means where the bytes live

    return resolve_checksum(config.checksum, torch.device("cuda" if backend == "nccl" else "cpu"))


EXPECTATIONS: tuple[Expectation, ...] = (
    Expectation("world_size", "{host} expects a transport group of {h} ranks, this {joiner} job has {j}",
                "the world size both sides pass"),
    Expectation("transport", "{host} uses transport {h}, this {joiner} job uses {j}", "weight_sync.transport",
                lambda config, stages, backend: config.transport, adoptable=True),
    Expectation("backend", "{host} uses backend {h}, this {joiner} job uses {j}", "weight_sync.backend",
                lambda config, stages, backend: backend),
    Expectation("num_inference_ranks", "{host} expects {h} inference ranks, this {joiner} job has {j}",
                "weight_sync.num_inference_ranks, and launch that many inference processes",
                lambda config, stages, backend: config.num_inference_ranks),
    Expectation("engine_tp_size", "{host} expects engines of {h} ranks (engine_tp_size), this {joiner} job has {j}",
                "weight_sync.engine_tp_size", lambda config, stages, backend: config.engine_tp_size),
    Expectation("trainer_stages", "{host} has {h} pipeline stages, this {joiner} job expects {j}",
                "the inference job's --trainer-stages, or leave it out: the trainer's is adopted",
                lambda config, stages, backend: "auto" if stages is None else stages, adoptable=True),
    Expectation("family", "{host} converts model family {h}, this {joiner} job serves {j}", "weight_sync.family",
                lambda config, stages, backend: config.family),
    Expectation("dtype", "{host} sends dtype {h}, this {joiner} job computes in {j}", "weight_sync.dtype",
                lambda config, stages, backend: config.dtype),
    Expectation("bucket_size_mb", "{host} cuts buckets of {h} MiB, this {joiner} job expects {j}",
                "weight_sync.bucket_size_mb",
                lambda config, stages, backend: "auto" if config.transport == "auto" else config.bucket_size_mb,
                adoptable=True),
    Expectation("draft", "{host} handles the draft (MTP) layers with draft={h}, this {joiner} job with {j}",
                "weight_sync.draft", lambda config, stages, backend: config.draft),
    Expectation("fleet", "{host} runs {h_fleet}, this {joiner} job {j_fleet}", "weight_sync.fleet.enabled",
                lambda config, stages, backend: config.fleet),
    Expectation("checksum", "{host} checks every bucket with {h}, this {joiner} job with {j}", "weight_sync.checksum",
                _checksum),
    Expectation("p2p_backend", "{host} moves P2P bytes with {h}, this {joiner} job with {j}",
                "weight_sync.p2p.backend", lambda config, stages, backend: config.p2p_backend),
    Expectation("p2p_protocol", "{host} runs Mooncake over {h}, this {joiner} job over {j}", "weight_sync.p2p.protocol",
                lambda config, stages, backend: config.p2p_protocol if config.p2p_backend == "mooncake" else None),
)
"""What the two jobs compare before any byte moves, in the order a refusal lists differences."""

COMMON = ("transport", "backend", "num_inference_ranks", "engine_tp_size", "trainer_stages", "family", "dtype",
          "bucket_size_mb", "draft", "fleet")
"""The rows every transport that meets at the store compares; a transport adds its own (`Transport.shares`)."""


def expectations(config: "WeightSyncConfig", *, trainer_stages: int, backend: str,
                 shares: Iterable[str] = ()) -> dict[str, Any]:
    """Return what a rank of either job assumes, from its settings (`backend`: resolved, gloo or nccl):
    the `COMMON` rows and the transport's own `shares` (the settings its two halves must agree on).

    A job with transport "auto" that has not resolved it (an inference job) presents "auto" for the
    transport and bucket size and no transport's own rows: it adopts the host's values once admitted,
    then checks its own settings of the chosen transport's rows (`transport_rows_differ`).
    """
    keys = {*COMMON, *shares}
    values = {row.key: row.value(config, trainer_stages, backend) for row in EXPECTATIONS
              if row.key in keys and row.value is not None}
    return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class Identity:
    """What a rank presents at the rendezvous (the host states its own the same way)."""

    job: str  # the launched job it belongs to; every rank of one job presents the same
    role: str  # "trainer" or "inference" ("member" in a bare transport group)
    member: int  # its index among its role's ranks (the inference rank; a trainer's joining-rank index)
    expects: Mapping[str, Any] = field(default_factory=dict)  # EXPECTATIONS keys
    model: Optional[Mapping[str, Any]] = None  # model_digest.model_fields of its HF config
    session: Optional[str] = None  # the session it asks for (None: whichever the host runs)
    failure: Optional[str] = None  # set when the rank failed while starting: a report, not a join
    engine: Optional[int] = None  # fleet: the engine this inference rank belongs to (`member`: its rank in it)
    nonce: str = ""  # fresh per presentation, part of what `proof` covers
    proof: Optional[str] = None  # keyed digest proving the session secret (`signed`); None without a secret

    def describe(self) -> str:
        """Return "inference rank 1 of job 'j'" (how messages name a rank; "rank 1 of engine 2" in a fleet)."""
        if self.engine is not None:
            return f"{self.role} rank {self.member} of engine {self.engine} (job {self.job!r})"
        return f"{self.role} rank {self.member} of job {self.job!r}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), default=str).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Identity":
        return cls(**json.loads(raw.decode()))


@dataclass(frozen=True)
class Decision:
    """The host's answer to one identity."""

    accepted: bool
    reason: str
    fatal: bool = False  # the session cannot complete: the host fails too, quoting `reason`
    generation: Optional[int] = None  # fleet: the generation of the engine an accepted rank joined

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        return cls(**json.loads(raw.decode()))


def _proof_parts(host: Identity, joiner: Optional[Identity] = None) -> tuple[str, ...]:
    """Return what a proof covers: the host's session and nonce, and (a joiner's) its whole identity."""
    if joiner is None:
        return ("host", host.session or "", host.nonce)
    return ("join", host.session or "", host.nonce, joiner.job, joiner.role, str(joiner.member), str(joiner.engine),
            joiner.failure or "", joiner.nonce)


def signed(identity: Identity, secret: Optional[SessionSecret], host: Optional[Identity] = None) -> Identity:
    """Return `identity` with a fresh nonce and the proof of `secret` (unchanged without a secret): a host's own
    identity when `host` is None, else a joiner's presentation to `host`."""
    if secret is None:
        return identity
    fresh = dataclasses.replace(identity, nonce=new_nonce(), proof=None)
    parts = _proof_parts(fresh) if host is None else _proof_parts(host, fresh)
    return dataclasses.replace(fresh, proof=secret.proof(*parts))


def host_unproven(host: Identity, secret: Optional[SessionSecret], where: str) -> Optional[str]:
    """Return why a joiner holding `secret` must not join the rendezvous at `where` whose host is `host`
    (None: it proves the same secret, or this joiner has none: the host then decides)."""
    if secret is None or secret.verifies(host.proof, *_proof_parts(host)):
        return None
    if host.proof is None:
        return (f"the rendezvous at {where} runs session {host.session!r} without a session secret, but this job "
                f"has {SECRET_ENV} set: set it on the trainer too (the same value), or on neither job")
    return (f"the rendezvous at {where} (session {host.session!r}) proves another session secret than this "
            f"job's: set {SECRET_ENV} to the same value on both jobs")


def disagreements(host: Identity, joiner: Identity) -> list[str]:
    """Return one sentence per expectation or model field on which `joiner` differs from `host`."""
    out = []
    for row in EXPECTATIONS:
        h, j = host.expects.get(row.key), joiner.expects.get(row.key)
        if j == "auto" and row.adoptable or joiner.expects.get("transport") == "auto" and row.key not in COMMON:
            continue  # adopted from the host; the chosen transport's own rows are checked once adopted
        if (row.key in host.expects or row.key in joiner.expects) and h != j:
            words = row.says.format(host=host.role, joiner=joiner.role, h=_show(h), j=_show(j),
                                    h_fleet=_fleet_words(h), j_fleet=_fleet_words(j))
            out.append(f"{words} (set {row.fix} alike on both jobs)")
    if host.model is not None and joiner.model is not None:
        for name, h, j in model_differences(host.model, joiner.model):
            out.append(f"the models differ in {name}: {host.role} {_show(h)}, this {joiner.role} job {_show(j)} "
                       f"(the trainer's HF config and the engine's config.json must define the same model)")
    return out


@dataclass
class Admission:
    """The host's record of a session: who was admitted, and why it failed (if it did)."""

    session: str
    host: Identity
    members: Mapping[str, int]  # role -> how many ranks of that role the session needs
    admitted: dict[str, dict[int, str]] = field(default_factory=dict)  # role -> member -> job
    failure: Optional[str] = None
    presented: dict[str, dict[int, str]] = field(default_factory=dict)  # role -> member -> job, of every rank
    # of the session's jobs that presented itself (admitted or not); a role's job is its first one
    engine_ranks: Optional[int] = None  # fleet: inference ranks join any time, as engines of this many ranks
    seats: dict[int, "EngineSeat"] = field(default_factory=dict)  # fleet: engine id -> its latest job
    secret: Optional[SessionSecret] = field(default=None, repr=False)  # what every joiner must prove

    def __post_init__(self) -> None:
        self.admitted.setdefault(self.host.role, {})[self.host.member] = self.host.job

    @property
    def complete(self) -> bool:
        """True once every member of every role was admitted."""
        return all(len(self.admitted.get(role, {})) == count for role, count in self.members.items())

    def job_of(self, role: str) -> Optional[str]:
        """Return the job admitted for `role`, or None before any of its ranks was."""
        taken = self.admitted.get(role)
        return next(iter(taken.values())) if taken else None

    @property
    def all_presented(self) -> bool:
        """True once every member of every role presented itself (admitted, refused or reporting a failure):
        after a failure, everyone was told why."""
        return all(m in self.presented.get(role, {}) or (role, m) == (self.host.role, self.host.member)
                   for role, count in self.members.items() for m in range(count))

    def decide(self, joiner: Identity, *, holder_alive: bool = False) -> Decision:
        """Return the answer to `joiner`, recording an admission or the session's failure.

        `holder_alive`: whether the job holding the engine seat `contested(joiner)` names still answers
        (the host asks over the network first); a live holder keeps its seat and the joiner is refused."""
        stranger = self._unproven(joiner)
        if stranger is not None:  # told why, and nothing of it is recorded: the session goes on undisturbed
            return Decision(False, stranger)
        seen = self.presented.setdefault(joiner.role, {})
        if joiner.role in self.members and (self.job_of(joiner.role) or next(iter(seen.values()), joiner.job)) \
                == joiner.job:
            seen[joiner.member] = joiner.job
        decision = self._judge(joiner, holder_alive)
        if decision.accepted:
            self.admitted.setdefault(joiner.role, {})[joiner.member] = joiner.job
        elif decision.fatal and self.failure is None:
            self.failure = decision.reason
        return decision

    def _unproven(self, joiner: Identity) -> Optional[str]:
        """Return why `joiner` does not prove the session secret (None: it proves it, or neither side has one)."""
        where = f"session {self.session!r}"
        if self.secret is None:
            if joiner.proof is None:
                return None
            return (f"{joiner.describe()} presents a session secret, but {where} runs without one: set {SECRET_ENV} "
                    "on the trainer too (the same value), or on neither job")
        if joiner.proof is None:
            return (f"{joiner.describe()} presents no session secret, but {where} requires one: set {SECRET_ENV} in "
                    "this job's environment to the trainer's")
        if not self.secret.verifies(joiner.proof, *_proof_parts(self.host, joiner)):
            return (f"{joiner.describe()} presents another session secret than {where}'s: set {SECRET_ENV} to the "
                    "same value on both jobs")
        return None

    def contested(self, joiner: Identity) -> Optional["EngineSeat"]:
        """Fleet: return the seat of `joiner`'s engine when another job holds it, so whether that job's ranks
        still answer decides (`decide(holder_alive=...)`); None when nothing needs asking."""
        if self.engine_ranks is None or joiner.role != "inference" or joiner.failure is not None \
                or self.failure is not None or self._unproven(joiner) is not None:
            return None
        seat = self.seats.get(joiner.engine) if isinstance(joiner.engine, int) else None
        if seat is None or seat.job == joiner.job or joiner.job in seat.superseded or not seat.ranks:
            return None
        return seat

    def _judge(self, joiner: Identity, holder_alive: bool) -> Decision:
        where = f"session {self.session!r}"
        if self.failure is not None:
            return Decision(False, f"{where} has failed: {self.failure}")
        if joiner.session is not None and joiner.session != self.session:
            return Decision(False, f"this job asked for session {joiner.session!r}, but the rendezvous runs "
                                   f"{where}; give both jobs the same weight_sync.run_id")
        if self.engine_ranks is not None and joiner.role == "inference":
            return self._judge_engine(joiner, where, holder_alive)
        own_job = self.job_of(joiner.role) in (None, joiner.job)  # the job that could complete the session
        if joiner.failure is not None:
            return Decision(False, f"{joiner.describe()} failed while starting: {joiner.failure}", fatal=own_job)
        if joiner.role not in self.members:
            return Decision(False, f"{where} has no {joiner.role!r} ranks (it takes {sorted(self.members)})")
        count, taken = self.members[joiner.role], self.admitted.get(joiner.role, {})
        if not own_job:
            return Decision(False, f"{where} already has {joiner.role} job {self.job_of(joiner.role)!r} "
                                   f"({len(taken)} of {count} {joiner.role} ranks joined); this {joiner.role} job "
                                   f"{joiner.job!r} is refused: is a second {joiner.role} job pointed at the same "
                                   "master_address:master_port?")
        problems = disagreements(self.host, joiner)
        if problems:
            return Decision(False, f"{joiner.describe()} cannot join {where}: " + "; ".join(problems), fatal=True)
        if not 0 <= joiner.member < count:
            return Decision(False, f"{where} needs {count} {joiner.role} ranks (0..{count - 1}); "
                                   f"this is {joiner.role} rank {joiner.member}", fatal=True)
        if joiner.member in taken:
            return Decision(False, f"{joiner.role} rank {joiner.member} of {where} was already taken by job "
                                   f"{taken[joiner.member]!r}")
        return Decision(True, f"accepted into {where} as {joiner.role} rank {joiner.member}")


    def _judge_engine(self, joiner: Identity, where: str, holder_alive: bool) -> Decision:
        """A fleet's engine rank: admitted whenever it comes, into its engine's latest generation. A new job
        presenting an engine id supersedes the job that held it once that job is gone (a restarted engine),
        and is refused while it still answers (two engines started with one id); a superseded job is refused
        from then on. A refusal is never fatal: the fleet goes on without that engine."""
        if joiner.failure is not None:
            return Decision(False, f"{joiner.describe()} failed while starting: {joiner.failure}")
        if not isinstance(joiner.engine, int) or joiner.engine < 0:
            return Decision(False, f"{where} is a fleet: an inference job must say which engine it is "
                                   "(weight_sync.engine_id: 0, 1, ...)")
        problems = disagreements(self.host, joiner)
        if problems:
            return Decision(False, f"{joiner.describe()} cannot join {where}: " + "; ".join(problems))
        if not 0 <= joiner.member < self.engine_ranks:
            return Decision(False, f"the engines of {where} have {self.engine_ranks} ranks (engine_tp_size); "
                                   f"this is rank {joiner.member}")
        seat = self.seats.get(joiner.engine)
        if seat is not None and joiner.job in seat.superseded:
            return Decision(False, f"engine {joiner.engine} of {where} is now job {seat.job!r} (generation "
                                   f"{seat.generation}); job {joiner.job!r} was superseded")
        if seat is not None and seat.job != joiner.job and holder_alive:
            return Decision(False, f"engine {joiner.engine} of {where} is held by job {seat.job!r} (generation "
                                   f"{seat.generation}), which still answers; this job {joiner.job!r} presenting "
                                   "the same engine id is refused: give each engine its own weight_sync.engine_id "
                                   "(a restarted engine is admitted once its earlier job is gone)")
        if seat is None or seat.job != joiner.job:
            seat = EngineSeat(joiner.job, 0 if seat is None else seat.generation + 1,
                              superseded=set() if seat is None else {*seat.superseded, seat.job})
            self.seats[joiner.engine] = seat
        if joiner.member in seat.ranks:
            return Decision(False, f"rank {joiner.member} of engine {joiner.engine} was already taken by job "
                                   f"{seat.job!r}")
        seat.ranks.add(joiner.member)
        return Decision(True, f"accepted into {where} as rank {joiner.member} of engine {joiner.engine} "
                              f"(generation {seat.generation})", generation=seat.generation)

    def complete_engines(self) -> dict[int, tuple[int, str]]:
        """Fleet: engine id -> (generation, job) of every engine whose ranks were all admitted."""
        return {engine: (seat.generation, seat.job) for engine, seat in self.seats.items()
                if len(seat.ranks) == self.engine_ranks}


@dataclass
class EngineSeat:
    """A fleet engine's latest job at the rendezvous: its generation and the ranks admitted so far."""

    job: str
    generation: int
    ranks: set[int] = field(default_factory=set)
    superseded: set[str] = field(default_factory=set)  # the engine's earlier jobs, refused from now on


def _fleet_words(fleet: Any) -> str:
    return "a fleet (each engine its own job, weight_sync.engine_id)" if fleet else "one inference job of fixed size"


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
