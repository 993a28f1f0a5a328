"""Transport "sglang": the trainer feeds SGLang servers through SGLang's own weight-update API.

- `transport`: `SGLangTransport` (the stage sources; rank 0 talks to the servers; how a failed
  sync is undone).
- `delivery`: how one bucket reaches the servers (update group broadcast, or colocated tensors).
- `group`: SGLang's update groups from the trainer's side (hosting the store, one group per server, rebuilds).
- `stages`: later pipeline stages' buckets reach rank 0.
- `restore`: rank 0's copies of the last good version, and how a failed sync is undone.
- `verify`: every TP rank of a server holds what TP rank 0 loaded.
- `disk`: the disk path, run on the engine host: a server fed from the disk-delta reader's local copy.
"""

from megatron_sync.transports.sglang.group import init_update_group
from megatron_sync.transports.sglang.transport import HTTPOnlyControl, SGLangTransport

__all__ = ["SGLangTransport", "HTTPOnlyControl", "init_update_group"]
