"""Point-to-point weight transfer: every trainer rank sends its own share straight to the
inference ranks that need it.

- `layout`: how an engine shards each HF tensor over its ranks and where each shard lives in
  a rank's staging memory (reference engine, vLLM).
- `assign`: which trainer rank converts and holds each tensor (the distributed host replica).
- `replica`: gathering each Megatron tensor to its assigned rank and converting it there.
- `plan`: the transfer plan, byte ranges per (sender, receiver), from both layouts.
- `movers`, `execute`: moving the planned bytes (torch.distributed or Mooncake) with per-range
  checksums and out-of-band completion.
"""
