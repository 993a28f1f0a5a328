"""Request bodies of SGLang's weight-update routes (SGLang 0.5.23, `sglang/srt/managers/io_struct.py`).

One builder per route; each returns the JSON body the route's request class
accepts. SGLang ignores unknown keys silently, so the tests check every body
against the request classes' field lists (recorded in tests, and against
SGLang's own classes where SGLang imports).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_sync.core.meta import dtype_name
from megatron_sync.plan.buckets import BucketPlan

GROUP_NAME = "megatron_sync"
"""The prefix of the update group's names: SGLang's ranks and the trainer wrap the rendezvous store in
PrefixStore(name), name = GROUP_NAME.{master_port}.{generation} (transport "sglang" rebuilds a broken group)."""

PARTIAL = "partial"
"""The weight version a server is tagged with when a failed sync could not be undone on it."""

ROUTES = {
    # route -> SGLang 0.5.23 request class (io_struct) the body must satisfy
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


def init_weights_update_group(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str) -> dict[str, Any]:
    """Return the body that makes an engine's TP rank t join the update group as rank rank_offset + t."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def destroy_weights_update_group(*, group_name: str) -> dict[str, Any]:
    """Return the body that makes the engine leave the update group."""
    return {"group_name": group_name}


def begin_weight_update() -> dict[str, Any]:
    """Return the body that opens a weight-update session on the target model."""
    return {"selector": "target"}


def end_weight_update() -> dict[str, Any]:
    """Return the body that closes the session (SGLang re-runs its post-load processing)."""
    return {}


def update_weights_from_distributed(bucket: BucketPlan, *, group_name: str,
                                    weight_version: Optional[str] = None) -> dict[str, Any]:
    """Return the body announcing one plan bucket, broadcast next as one flattened uint8 tensor from rank 0.

    SGLang rebuilds the tensors by walking names/dtypes/shapes in order with
    no padding, so the bucket's entries must be contiguous and aligned; the
    cache is flushed once per sync by the client, not per bucket.
    """
    _check_flattened_layout(bucket)
    entries = bucket.entries
    return {
        "names": [e.name for e in entries],
        "dtypes": [dtype_name(e.dtype) for e in entries],
        "shapes": [list(e.shape) for e in entries],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": weight_version,
    }


def pause_generation(mode: str) -> dict[str, Any]:
    """Return the body that pauses generation: mode "abort", "retract" or "in_place"."""
    return {"mode": mode}


def continue_generation() -> dict[str, Any]:
    """Return the body that resumes generation."""
    return {"torch_empty_cache": True}


def update_weight_version(version: "int | str") -> dict[str, Any]:
    """Return the body that tags the served weights as `version` (requests were already handled by the pause)."""
    return {"new_version": str(version), "abort_all_requests": False}


def _check_flattened_layout(bucket: BucketPlan) -> None:
    offset = 0
    for e in bucket.entries:
        if e.offset != offset or e.offset % e.dtype.itemsize:
            raise ValueError(
                f"bucket {bucket.index}: {e.name!r} sits at byte {e.offset}, but SGLang's flattened_bucket "
                f"expects it at {offset}, aligned to {e.dtype.itemsize}; the plan must pack buckets contiguously "
                "in entry order (largest dtype first)"
            )
        offset += e.nbytes
    if offset != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} holds {bucket.nbytes} bytes but its entries cover {offset}")

