"""A vLLM worker's speculative MTP draft model as part of its layout: recorded, staged and loaded with the target.

vLLM runs an MTP draft (`--speculative-config '{"method": "mtp", ...}'`) as a
model of its own (`deepseek_mtp`, `glm4_moe_mtp`, ...) whose decoder layer,
`enorm`, `hnorm`, `eh_proj` and `shared_head.norm` load from the checkpoint's
layer `num_hidden_layers + d`, while its embedding and head are the target's own
modules (vLLM's proposer shares them when the engine runs PP=1). The worker is
handed the draft model through vLLM's draft session (`set_weight_update_target`
in `start_draft_weight_update`); from then on the draft's params are part of
the worker's `RankLayout` under the `DRAFT` prefix, recorded from the draft's
own loaders (`layout.record_rank_layout`) over the checkpoint's draft-layer
tensors, and loaded through the same layerwise reload as the target's. The
modules it shares with the target are set aside while the draft's layout is
recorded or its params are loaded (`owned_only`): they are the target's, and
are loaded with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Iterator, Mapping

import torch

from megatron_sync.core.meta import TensorMeta
from megatron_sync.engines.vllm.layout import load_params, record_rank_layout
from megatron_sync.layout.rank import RankLayout

DRAFT = "draft:"
"""The prefix of the draft model's params in a worker's layout (no dot: a param's layer is its name's prefix)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def draft_metas(metas: list[TensorMeta], num_hidden_layers: int) -> list[TensorMeta]:
    """Return the checkpoint tensors of the draft layers (layer index >= `num_hidden_layers`)."""
    return [m for m in metas if (found := _LAYER.match(m.name)) and int(found.group(1)) >= num_hidden_layers]


class _SharedWithTarget(torch.nn.Module):
    """Stands in for a module the draft shares with the target while the draft is recorded or loaded."""


@contextlib.contextmanager
def owned_only(draft: torch.nn.Module, target: torch.nn.Module) -> Iterator[None]:
    """Within the block, every module `draft` shares with `target` (the embedding, the head) is replaced by an
    empty stand-in, so the draft's reload touches only what is the draft's own; they are put back after."""
    shared = {id(m) for m in target.modules()}
    replaced = [(parent, name, child) for parent in draft.modules() for name, child in parent._modules.items()
                if child is not None and id(child) in shared]
    for parent, name, _ in replaced:
        parent._modules[name] = _SharedWithTarget()
    try:
        yield
    finally:
        for parent, name, child in replaced:
            parent._modules[name] = child


@dataclasses.dataclass
class DraftModel:
    """The draft model vLLM runs beside the target (`model`, `model_config`) and its layout in this worker."""

    model: torch.nn.Module
    model_config: Any
    layout: RankLayout = dataclasses.field(default_factory=lambda: RankLayout((), ()))

    def record(self, target: torch.nn.Module, metas: list[TensorMeta], num_hidden_layers: int, *,
               who: str) -> RankLayout:
        """Record the draft's layout from its own loaders over the draft-layer tensors of `metas`; return it
        with every param under the `DRAFT` prefix."""
        with owned_only(self.model, target):
            own = record_rank_layout(self.model, draft_metas(metas, num_hidden_layers), who=f"{who} (draft)")
        self.layout = own
        return RankLayout(tuple(dataclasses.replace(p, name=DRAFT + p.name) for p in own.params),
                          tuple(dataclasses.replace(p, param=DRAFT + p.param) for p in own.placements))

    def load(self, target: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        """Load the draft's params (by their own names, the prefix removed) through the layerwise reload."""
        with owned_only(self.model, target):
            load_params(self.model, self.model_config, params)

    def params_of(self, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the draft's params cut from the full checkpoint tensors it needs (read from `checkpoint`'s
        items: only the draft layers' are kept)."""
        needed = set(self.layout.by_name)
        return self.layout.params_from({name: t for name, t in checkpoint.items() if name in needed})


def split_draft(shards: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return (the target's params, the draft's params by their own names) of a worker's staged `shards`."""
    target = {name: t for name, t in shards.items() if not name.startswith(DRAFT)}
    draft = {name[len(DRAFT):]: t for name, t in shards.items() if name.startswith(DRAFT)}
    return target, draft
