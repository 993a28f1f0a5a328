"""Walk Megatron model chunks: every local parameter and needed buffer, with its global name
and how it is sharded.

Global names are Megatron's single-rank names: decoder layers by their global index, routed
experts by their global index, the multi-token-prediction block's layers (`mtp.layers.{d}`, on
the last pipeline stage) by their global depth. A stage that holds the MTP block but not the
first layer keeps Megatron's copy of the word embedding for it; that copy is named
`MTP_STAGE_EMBEDDING`, apart from the first stage's embedding it mirrors.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_sync.convert.families.mtp import MTP_STAGE_EMBEDDING
from megatron_sync.core.grid import ParallelLayout

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_PART = re.compile(r"^transformer_layer\.(.+)$")  # the decoder layer inside an MTP depth
_EMBEDDING = "embedding.word_embeddings.weight"
# Routed experts in the two Megatron namings: SequentialMLP and TEGroupedMLP.
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")


@dataclass(frozen=True)
class Split:
    """How a local tensor is split: over which axis ("tp", "etp" or None), along which dim,
    and with which stride: an int s when each shard holds s equal pieces (2 for gated
    linear_fc1, whose shards each hold [gate_r; up_r]), or the sizes, in the full tensor, of
    unequal pieces each shard holds its 1/size part of (a gated-delta-net in_proj holds
    [q_r; k_r; v_r; z_r; beta_r; alpha_r])."""

    axis: str | None = None
    dim: int = 0
    stride: int | tuple[int, ...] = 1


def _gdn_in_proj_pieces(gdn) -> Split:
    return Split("tp", 0, (gdn.qk_dim, gdn.qk_dim, gdn.v_dim, gdn.v_dim,
                              gdn.num_value_heads, gdn.num_value_heads))


def _gdn_conv_pieces(gdn) -> Split:
    return Split("tp", 0, (gdn.qk_dim, gdn.qk_dim, gdn.v_dim))


# Parameters whose TP split megatron-core 0.16.1 declares only in its modules' sharded_state_dict
# (no partition_dim attribute, or pieces the attribute cannot say): (module class, parameter) ->
# the split, from the module. The learnable softmax offset (attention sinks) is one per head; the
# gated delta net's per-head A_log / dt_bias, and its in_proj / conv1d, whose TP shards each hold
# a part of every q/k/v(/z/beta/alpha) piece.
_DECLARED_SHARDING = {
    ("DotProductAttention", "softmax_offset"): lambda m: Split("tp", 0),
    ("TEDotProductAttention", "softmax_offset"): lambda m: Split("tp", 0),
    ("GatedDeltaNet", "A_log"): lambda m: Split("tp", 0),
    ("GatedDeltaNet", "dt_bias"): lambda m: Split("tp", 0),
    ("GatedDeltaNet", "in_proj.weight"): _gdn_in_proj_pieces,
    ("GatedDeltaNet", "conv1d.weight"): _gdn_conv_pieces,
    ("GatedDeltaNet", "conv1d.bias"): _gdn_conv_pieces,
}


def _declared_shardings(model: torch.nn.Module) -> dict[str, Split]:
    """Return local parameter name -> split for the parameters `_DECLARED_SHARDING` describes."""
    declared = {}
    for module_name, module in model.named_modules():
        for (cls, param), split in _DECLARED_SHARDING.items():
            if type(module).__name__ == cls:
                declared[f"{module_name}.{param}" if module_name else param] = split(module)
    return declared


@dataclass(frozen=True)
class ExpertSlot:
    """Where a routed expert tensor sits: its layer (an MTP depth d counts as layer num_layers + d),
    its kind (name with {expert} left open)."""

    layer: int
    template: str  # global name with "{expert}" in place of the expert index
    local_index: int
    num_local: int


@dataclass(frozen=True)
class SourceTensor:
    """One local parameter or buffer: its global Megatron name, data and sharding."""

    name: str
    tensor: torch.Tensor
    sharding: Split
    expert: ExpertSlot | None = None


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """Return the bare model inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _layer_numbers(chunk: torch.nn.Module, block: str) -> list[int]:
    """Return the global 0-based index of each layer of the chunk's `block` ("decoder" or "mtp")."""
    module = getattr(chunk, block, None)
    if module is None:
        return []
    return [layer.layer_number - 1 for layer in module.layers]  # Megatron counts from 1


def _expert_slot(prefix: str, rest: str, layer: int, num_local: int, ep_rank: int) -> tuple[str, ExpertSlot] | None:
    """Return (global name, slot) for a routed-expert name tail under the layer `prefix`, or None if it is not one."""
    seq = _SEQUENTIAL_EXPERT.match(rest)
    if seq:
        j, tail = int(seq.group(1)), seq.group(2)
        template = f"{prefix}mlp.experts.local_experts.{{expert}}.{tail}"
    else:
        grouped = _GROUPED_EXPERT.match(rest)
        if not grouped:
            return None
        tail, j = grouped.group(1), int(grouped.group(2))
        template = f"{prefix}mlp.experts.{tail}{{expert}}"
    if j >= num_local:
        raise ValueError(
            f"local expert index {j} in {prefix}{rest} is not below the "
            f"{num_local} local experts implied by num_moe_experts/ep; check the model config"
        )
    slot = ExpertSlot(layer=layer, template=template, local_index=j, num_local=num_local)
    return template.format(expert=ep_rank * num_local + j), slot


@dataclass(frozen=True)
class _ChunkIndex:
    """What naming a chunk's parameters globally needs, read once per chunk."""

    decoder_layers: list[int]  # global 0-based index of each local decoder layer
    mtp_depths: list[int]  # global depth of each local MTP layer
    num_layers: int  # decoder layers of the whole model (an MTP depth's experts group as layer num_layers + d)
    mtp_stage_embedding: bool  # the embedding is Megatron's copy for the MTP block, not the first stage's
    num_local: int  # routed experts per EP rank (0: no MoE)
    ep_rank: int

    @classmethod
    def of(cls, model: torch.nn.Module, layout: ParallelLayout) -> "_ChunkIndex":
        config = getattr(model, "config", None)
        num_experts = getattr(config, "num_moe_experts", None) or 0
        return cls(
            decoder_layers=_layer_numbers(model, "decoder"), mtp_depths=_layer_numbers(model, "mtp"),
            num_layers=getattr(config, "num_layers", 0) or 0,
            mtp_stage_embedding=getattr(model, "mtp_process", False) and not getattr(model, "pre_process", True),
            num_local=num_experts // layout.ep if num_experts else 0, ep_rank=layout.ep_rank,
        )


def _global_name(local_name: str, chunk: _ChunkIndex) -> tuple[str, ExpertSlot | None]:
    """Return the global Megatron name of a chunk-local parameter name, and its expert slot if it is a routed expert."""
    m = _LOCAL_LAYER.match(local_name)
    if m:
        layer = chunk.decoder_layers[int(m.group(1))]
        prefix, rest, slot_layer = f"decoder.layers.{layer}.", m.group(2), layer
    else:
        m = _LOCAL_MTP_LAYER.match(local_name)
        if not m:
            return (MTP_STAGE_EMBEDDING if local_name == _EMBEDDING and chunk.mtp_stage_embedding else local_name), None
        depth = chunk.mtp_depths[int(m.group(1))]
        inner = _MTP_LAYER_PART.match(m.group(2))
        if not inner:  # the depth's own norms and projection
            return f"mtp.layers.{depth}.{m.group(2)}", None
        prefix, rest = f"mtp.layers.{depth}.transformer_layer.", inner.group(1)
        slot_layer = chunk.num_layers + depth
    found = _expert_slot(prefix, rest, slot_layer, chunk.num_local, chunk.ep_rank) if chunk.num_local else None
    return found if found else (prefix + rest, None)


def _sharding_of(param: torch.Tensor, is_expert: bool) -> Split:
    if not getattr(param, "tensor_model_parallel", False):
        return Split()
    return Split(
        axis="etp" if is_expert else "tp",
        dim=int(getattr(param, "partition_dim")),
        stride=int(getattr(param, "partition_stride", 1)),
    )


def walk_chunk(
    chunk: torch.nn.Module,
    layout: ParallelLayout,
    *,
    is_buffer: Callable[[str], bool] = lambda name: False,
) -> list[SourceTensor]:
    """Return one model chunk's parameters, and the buffers `is_buffer` names, with global names.

    Layer indices get the chunk's PP/VPP offset (read from each layer's own
    `layer_number`, MTP layers likewise), routed experts get their global index
    (`ep_rank * num_local + j`), and sharding comes from Megatron's
    `tensor_model_parallel` / `partition_dim` / `partition_stride` attributes,
    or from `_DECLARED_SHARDING` where megatron-core declares it only in a module.
    """
    model = unwrap_chunk(chunk)
    index = _ChunkIndex.of(model, layout)
    declared = _declared_shardings(model)
    named = [(n, p, True) for n, p in model.named_parameters()]
    named += [(n, b, False) for n, b in model.named_buffers()]

    out = []
    for local_name, tensor, is_param in named:
        name, expert = _global_name(local_name, index)
        if is_param or is_buffer(name):
            sharding = declared.get(local_name) or _sharding_of(tensor, expert is not None)
            out.append(SourceTensor(name, tensor.detach(), sharding, expert))
    return out


def walk_model_chunks(chunks: list[torch.nn.Module], layout: ParallelLayout, **kwargs) -> list[SourceTensor]:
    """Return the source tensors of every chunk of this rank, virtual pipeline stages in order."""
    out: list[SourceTensor] = []
    for chunk in chunks:
        out.extend(walk_chunk(chunk, layout, **kwargs))
    duplicates = [n for n, c in Counter(t.name for t in out).items() if c > 1]
    assert not duplicates, f"global names collide across model chunks: {sorted(duplicates)[:5]}"
    return out
