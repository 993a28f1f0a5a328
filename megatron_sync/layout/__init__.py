"""The engine layout: which part of which HF checkpoint tensor each inference rank holds, and where.

The one contract between transports and engines. An engine rank publishes a
`RankLayout` (its params, and for each a list of `Placement`s: which `Region`
of which full HF tensor lands at which byte offset of which param); every
transport plans from it and every receiver writes through it.

- `regions`: `Region` (a strided view of a full tensor) and the one place a
  tensor-, expert- or vocabulary-parallel slice is computed (`role_range`,
  `expert_range`, `rank_region`).
- `rank`: `TensorSpec`, `Placement`, `ParamSpec`, `RankLayout` and their wire forms.
- `roles`: `RoleLayout`, a layout computed from each tensor's shard role (the
  reference engine's, and vLLM-style vocabulary blocks for planning at scale).
- `staging`: `StagingSets`, the two flat buffers of one rank's params a version is
  received into.

This package imports no driver, transport or engine.
"""
