"""The session secret: both jobs prove at the rendezvous that they hold it, without ever sending it.

Every rank of both jobs reads the secret once, from the environment variable
`MEGATRON_SYNC_SECRET` (the drivers call `SessionSecret.from_environment`); an
unset or empty variable means no secret. The rendezvous store is readable by
anyone who can reach its port, so the secret itself never goes there: the host
presents a keyed digest (HMAC-SHA256) of its session id and a fresh nonce, and
every joiner a keyed digest of the host's id and nonce and its own identity
(job, role, rank, engine, failure report) and nonce. The host checks each in
constant time (`hmac.compare_digest`) and refuses, by name, a joiner without a
proof, with another secret's proof, or with a proof when the host has no
secret; a joiner checks the host's proof the same way before it joins.

What it guards against: a job of another run, a misconfigured job or a stranger
joining a session (and failing it with a forged failure report). It does not
encrypt the traffic: anyone who can read the store can read what it carries.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import uuid
from typing import Mapping, Optional

SECRET_ENV = "MEGATRON_SYNC_SECRET"
"""The environment variable both jobs read their session secret from (the same value on every rank)."""


class SessionSecret:
    """A session secret held in memory; it shows as `SessionSecret(<hidden>)` wherever it is printed."""

    __slots__ = ("_key",)

    def __init__(self, value: str) -> None:
        if not value:
            raise ValueError(f"a session secret must not be empty (unset {SECRET_ENV} to run without one)")
        self._key = value.encode()

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["SessionSecret"]:
        """Return the secret in `SECRET_ENV` (of `environ`, default the process's), or None when unset or empty."""
        value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
        return cls(value) if value else None

    def proof(self, *parts: str) -> str:
        """Return the keyed digest of `parts` (hex): what a rank presents instead of the secret."""
        return hmac.new(self._key, "\x1f".join(parts).encode(), hashlib.sha256).hexdigest()

    def verifies(self, proof: Optional[str], *parts: str) -> bool:
        """True when `proof` is this secret's digest of `parts` (compared in constant time)."""
        return isinstance(proof, str) and hmac.compare_digest(self.proof(*parts), proof)

    def __repr__(self) -> str:
        return "SessionSecret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a SessionSecret is not pickled: each process reads it from its own environment")


def new_nonce() -> str:
    """Return a fresh random nonce for one proof."""
    return uuid.uuid4().hex
