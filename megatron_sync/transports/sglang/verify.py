"""Did every TP rank of a server apply the version? SGLang 0.5.23 answers a weight update from TP rank 0 only.

A load that fails on another TP rank is only logged there. So rank 0 reads
each multi-rank server's per-rank parameter digests (/weights_checker, action
"checksum": every rank hashes its own parameters, with the same hash function
on every rank of a server). At start-up it records which parameters every
rank holds whole (equal on all ranks: norms, and whatever SGLang does not
shard); before committing a version it requires them to be equal on every
rank again, i.e. equal to TP rank 0's, whose answer said it loaded the
version. The digests cover the whole model on every rank once per sync.
"""

from __future__ import annotations

from typing import Optional

from megatron_sync.engines.sglang.client import call_sglang


def _rank_digests(url: str, timeout_s: float) -> list[tuple[int, dict[str, str]]]:
    """Return (TP rank, {param: digest}) of every rank of the server, by TP rank."""
    answer = call_sglang(url, "/weights_checker", body={"action": "checksum", "selector": "target"},
                         timeout_s=timeout_s)
    ranks = []
    for rank in answer.get("ranks") or []:
        info = rank["parallelism_info"]  # one entry per runner role (a list once merged, as 0.5.23 answers)
        info = info[0] if isinstance(info, list) else info
        ranks.append((info["tp_rank"], rank["checksums"]))
    return sorted(ranks)


def replicated_params(url: str, timeout_s: float) -> frozenset[str]:
    """Return the parameters every TP rank of the server holds whole (empty for one rank)."""
    ranks = _rank_digests(url, timeout_s)
    if len(ranks) < 2:
        return frozenset()
    first = ranks[0][1]
    return frozenset(name for name in first if all(digests.get(name) == first[name] for _, digests in ranks))


def ranks_disagree(url: str, replicated: frozenset[str], timeout_s: float) -> Optional[str]:
    """Return which TP rank holds a replicated parameter that differs from TP rank 0's (None: none does)."""
    if not replicated:
        return None
    ranks = _rank_digests(url, timeout_s)
    first = ranks[0][1]
    for rank, digests in ranks[1:]:
        differ = sorted(name for name in replicated if digests.get(name) != first.get(name))
        if differ:
            return (f"TP rank {rank} holds {differ[:3]}{' ...' if len(differ) > 3 else ''} unlike TP rank 0: it did "
                    "not apply this version (SGLang reports a rank's failed load only in its own log)")
    return None
