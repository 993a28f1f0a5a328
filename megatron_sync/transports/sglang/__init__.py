"""Transport "sglang": the trainer feeds SGLang servers through SGLang's own weight-update API.

- `transport`: `SGLangTransport` (the stage sources; rank 0 talks to the servers; how a failed
  sync is undone).
- `delivery`: how one bucket reaches the servers (update group broadcast, or colocated tensors).
- `group`: SGLang's update group from the trainer's side (hosting its store, the servers' joins, rebuilds).
- `stages`: later pipeline stages' buckets reach rank 0.
"""

from megatron_sync.transports.sglang.group import init_update_group
from megatron_sync.transports.sglang.transport import HTTPOnlyControl, SGLangTransport

__all__ = ["SGLangTransport", "HTTPOnlyControl", "init_update_group"]
