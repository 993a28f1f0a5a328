"""Run inside SGLang's own environment (a subprocess of the tests): SGLang's own code checks what the client
sends. Imports only SGLang and torch (never megatron_sync).

    python -m tests.support.sglang_checks bodies   < {route: [body, ...], ...}     -> {route: problem or null}
    python -m tests.support.sglang_checks receive PORT GROUP < [body, ...]         -> {name: hex bytes}
"""

from __future__ import annotations

import json
import os
import sys


def check_bodies(bodies: dict[str, list[dict]], classes: dict[str, str]) -> dict[str, str | None]:
    """Return, per route, what SGLang's request class refuses in the client's bodies (None: all accepted)."""
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    problems: dict[str, str | None] = {}
    for route, route_bodies in bodies.items():
        cls = getattr(io_struct, classes[route])
        declared = {f.name for f in msgspec.structs.fields(cls)}
        problems[route] = None
        for body in route_bodies:
            unknown = sorted(set(body) - declared)
            if unknown:
                problems[route] = f"{unknown} are not {cls.__name__} fields"
                break
            try:
                parsed = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))  # what FastAPI does
            except pydantic.ValidationError as e:
                problems[route] = str(e)
                break
            changed = [k for k, v in body.items() if getattr(parsed, k) != v]
            if changed:
                problems[route] = f"{changed} did not survive parsing"
                break
    return problems


def receive(port: int, group_name: str, bodies: list[dict]) -> dict[str, str]:
    """Join the update group as rank 1 with SGLang's own function; receive flattened buckets with SGLang's own
    class; return each tensor's bytes as hex."""
    import torch
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                   group_name=group_name)
    received = {}
    for body in bodies:
        bucket = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        received.update({name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()
                         for name, t in bucket.reconstruct_tensors()})
    torch.distributed.destroy_process_group(pg)
    return received


if __name__ == "__main__":
    command, payload = sys.argv[1], json.load(sys.stdin)
    if command == "bodies":
        out = check_bodies(payload["bodies"], payload["classes"])
    else:
        out = receive(int(sys.argv[2]), sys.argv[3], payload)
    print("RESULT " + json.dumps(out), flush=True)
    # Leave without running C++ static destructors: gloo's, after the peer closed its side, can abort the
    # process ("terminate called without an active exception") once the result is already out.
    os._exit(0)
