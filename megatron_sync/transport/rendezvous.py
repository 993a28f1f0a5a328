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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from megatron_sync.model_digest import model_differences

if TYPE_CHECKING:
    from megatron_sync.config import WeightSyncConfig


@dataclass(frozen=True)
class Expectation:
    """One layout fact both jobs must agree on; `says` words a disagreement, host's value first."""

    key: str
    says: str  # "{host} ... {h} ..., this {joiner} job ... {j}"
    fix: str  # where an operator sets it
    adoptable: bool = False  # a joiner that says "auto" takes the host's value (transport: auto)


EXPECTATIONS: tuple[Expectation, ...] = (
    Expectation("world_size", "{host} expects a transport group of {h} ranks, this {joiner} job has {j}",
                "the world size both sides pass"),
    Expectation("transport", "{host} uses transport {h}, this {joiner} job uses {j}", "weight_sync.transport",
                adoptable=True),
    Expectation("backend", "{host} uses backend {h}, this {joiner} job uses {j}", "weight_sync.backend"),
    Expectation("num_inference_ranks", "{host} expects {h} inference ranks, this {joiner} job has {j}",
                "weight_sync.num_inference_ranks, and launch that many inference processes"),
    Expectation("engine_tp_size", "{host} expects engines of {h} ranks (engine_tp_size), this {joiner} job has {j}",
                "weight_sync.engine_tp_size"),
    Expectation("trainer_stages", "{host} has {h} pipeline stages, this {joiner} job expects {j}",
                "the inference job's --trainer-stages (the trainer's pipeline-parallel size)"),
    Expectation("family", "{host} converts model family {h}, this {joiner} job serves {j}", "weight_sync.family"),
    Expectation("dtype", "{host} sends dtype {h}, this {joiner} job computes in {j}", "weight_sync.dtype"),
    Expectation("bucket_size_mb", "{host} cuts buckets of {h} MiB, this {joiner} job expects {j}",
                "weight_sync.bucket_size_mb", adoptable=True),
)
"""What the two jobs compare before any byte moves, in the order a refusal lists differences."""


def expectations(config: "WeightSyncConfig", *, trainer_stages: int, backend: str) -> dict[str, Any]:
    """Return what a rank of either job assumes, from its settings (`backend`: resolved, gloo or nccl).

    A job with transport "auto" that has not resolved it (an inference job) leaves transport and bucket
    size to the host: it presents "auto" for both and adopts the host's values once admitted.
    """
    auto = config.transport == "auto"
    return {"transport": config.transport, "backend": backend, "num_inference_ranks": config.num_inference_ranks,
            "engine_tp_size": config.engine_tp_size, "trainer_stages": trainer_stages, "family": config.family,
            "dtype": config.dtype, "bucket_size_mb": "auto" if auto else config.bucket_size_mb}


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

    def describe(self) -> str:
        """Return "inference rank 1 of job 'j'" (how messages name a rank)."""
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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        return cls(**json.loads(raw.decode()))


def disagreements(host: Identity, joiner: Identity) -> list[str]:
    """Return one sentence per expectation or model field on which `joiner` differs from `host`."""
    out = []
    for row in EXPECTATIONS:
        h, j = host.expects.get(row.key), joiner.expects.get(row.key)
        if row.adoptable and j == "auto":
            continue
        if (row.key in host.expects or row.key in joiner.expects) and h != j:
            words = row.says.format(host=host.role, joiner=joiner.role, h=_show(h), j=_show(j))
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

    def decide(self, joiner: Identity) -> Decision:
        """Return the answer to `joiner`, recording an admission or the session's failure."""
        decision = self._judge(joiner)
        if decision.accepted:
            self.admitted.setdefault(joiner.role, {})[joiner.member] = joiner.job
        elif decision.fatal and self.failure is None:
            self.failure = decision.reason
        return decision

    def _judge(self, joiner: Identity) -> Decision:
        where = f"session {self.session!r}"
        if self.failure is not None:
            return Decision(False, f"{where} has failed: {self.failure}")
        if joiner.session is not None and joiner.session != self.session:
            return Decision(False, f"this job asked for session {joiner.session!r}, but the rendezvous runs "
                                   f"{where}; give both jobs the same weight_sync.run_id")
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


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
