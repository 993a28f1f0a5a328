"""What an engine rank's params must hold once a version is loaded, and the check against what they hold.

Wire checksums prove the bytes arrived; they do not prove the engine computes with them (a load that
copies the wrong region, a post-processing step that writes back, a stale draft). So while a version is
received, a receiver records the digest every region of its layout must have, from bytes whose wire
checksum matched the trainer's (a bucket's regions as they lie in the verified bucket; a P2P piece's own
checksum as the trainer computed it on its arena); once the engine loaded the version, the same digests
are computed on what the engine's params hold (`EngineAdapter.loaded_params`, drafts included) and a
mismatch names the rank, the param and the region. A param that post-load processing repacks or
requantizes is checked on the values handed to that processing (the adapter returns those).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megatron_sync.core.checksum import checksum
from megatron_sync.layout.rank import RankLayout


@dataclass(frozen=True)
class RegionDigest:
    """Bytes [offset, offset + nbytes) of param `param` must have `digest`: a region (`what`) of HF tensor `name`."""

    param: str
    offset: int
    nbytes: int
    name: str
    what: str
    digest: int


class ExpectedRegions:
    """The digests one rank's regions must have once the version being received is loaded."""

    def __init__(self, layout: RankLayout, algorithm: str) -> None:
        self.layout, self.algorithm = layout, algorithm
        self.regions: list[RegionDigest] = []
        params = sorted(layout.param_offsets.items(), key=lambda kv: kv[1])
        self._starts, self._names = [at for _, at in params], [name for name, _ in params]

    def begin(self) -> None:
        """Forget the previous version's digests."""
        self.regions = []

    def record_tensor(self, name: str, full: torch.Tensor) -> None:
        """Record the digest of every region of full HF tensor `name` this rank holds (verified bytes)."""
        for p in self.layout.by_name.get(name, ()):
            source = p.source.of(full).contiguous().view(-1).view(torch.uint8)
            self.regions.append(RegionDigest(p.param, p.offset, p.nbytes, name, f"region at {p.source.offset}",
                                             checksum(source, self.algorithm)))

    def record_piece(self, dst: int, nbytes: int, name: str, what: str, digest: int) -> None:
        """Record a piece of the staging set (`dst`: its offset there) whose digest the trainer computed."""
        k = bisect.bisect_right(self._starts, dst) - 1
        param = self._names[k]
        self.regions.append(RegionDigest(param, dst - self._starts[k], nbytes, name, what, digest))

    def check(self, params: Mapping[str, torch.Tensor], who: str, limit: int = 3) -> Optional[str]:
        """Return what differs between `params` (what the engine holds, by layout param name) and the recorded
        digests, naming `who`, each param and region (at most `limit` of them, and how many); None if nothing."""
        wrong = []
        flat = {name: t.detach().contiguous().view(-1).view(torch.uint8) for name, t in params.items()}
        for r in self.regions:
            held = flat.get(r.param)
            if held is None:
                wrong.append(f"{r.param} is not among the params the engine shows")
                continue
            got = checksum(held[r.offset:r.offset + r.nbytes], self.algorithm)
            if got != r.digest:
                wrong.append(f"{r.param} bytes [{r.offset}, {r.offset + r.nbytes}) ({r.what} of {r.name}) hold "
                             f"{self.algorithm} {got:#x}, the trainer sent {r.digest:#x}")
        if not wrong:
            return None
        more = f" and {len(wrong) - limit} more" if len(wrong) > limit else ""
        return f"{who}: the loaded weights differ from what was sent: {'; '.join(wrong[:limit])}{more}"


class LoadCheck:
    """One receiver's post-load check: due every `every` versions (0: never; the first version always when on),
    against the digests recorded while the version was received; `engine.loaded_params()` shows what it holds.

    An engine that cannot show its params (no `loaded_params`, or it returns None) is not checked; with
    checksum "none" nothing can be recorded against, so the check is off.
    """

    def __init__(self, layout: RankLayout, engine: object, algorithm: str, every: int, who: str) -> None:
        self.engine, self.every, self.who = engine, every, who
        self.expected = ExpectedRegions(layout, algorithm)
        self.on = bool(every) and algorithm != "none" and callable(getattr(engine, "loaded_params", None))
        self.due = False

    def begin(self, version: int) -> None:
        """Start recording `version`'s digests when its check is due."""
        self.due = self.on and (version - 1) % self.every == 0
        self.expected.begin()

    def skip(self) -> None:
        """The version being received is not checked (it comes from where nothing is recorded: a relay)."""
        self.due = False

    def record_tensor(self, name: str, full: torch.Tensor) -> None:
        """`ExpectedRegions.record_tensor`, when due."""
        if self.due:
            self.expected.record_tensor(name, full)

    def record_piece(self, dst: int, nbytes: int, name: str, what: str, digest: int) -> None:
        """`ExpectedRegions.record_piece`, when due."""
        if self.due:
            self.expected.record_piece(dst, nbytes, name, what, digest)

    def __call__(self, version: int) -> Optional[str]:
        """Return what the loaded engine holds that it should not (None: all as sent, or not due)."""
        if not self.due:
            return None
        params = self.engine.loaded_params()
        return None if params is None else self.expected.check(params, self.who)
