"""The Megatron side of a sync at full size, from a family's rule table, on meta tensors.

Every Megatron parameter that produces the HF checkpoint is derived from the family's rules (the first
rule that outputs each HF tensor: a family lists the local-spec and Transformer-Engine namings side by
side), with its full shape (a rule's outputs concatenated on dim 0; the vocabulary padded as Megatron
pads it), its TP/ETP sharding (from the shard role, gate/up with stride 2; a few parameters megatron-core
splits although engines replicate them), and its layer and expert. One rank of each pipeline stage (EP
rank 0, with its local experts) is built as meta-device `SourceTensor`s and walked by
`gather.plan_gather_units`, the units every stage walks in a real sync; `gather_traffic`
says which rank's shards reach which rank for a unit's destination.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_sync.convert.base import Shard
from megatron_sync.convert.layout import gate_up, vocab
from megatron_sync.trainer.gather import GatherUnit, plan_gather_units
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.scale.layouts import TrainerLayout
from megatron_sync.trainer.source import ExpertSlot, Split, SourceTensor

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # a layer or expert index inside a dotted name
_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)\d+")  # a routed expert's index within its layer's name
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # the checkpoint's layer of an HF tensor
_MAKE_VOCAB_DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by


@dataclass(frozen=True)
class MegatronTensor:
    """One full Megatron parameter: its name, full shape, sharding, layer and expert (None: not one)."""

    name: str
    shape: tuple[int, ...]
    sharding: Split
    layer: int | None  # the checkpoint's layer (a draft layer's is num_hidden_layers + its depth)
    expert: int | None
    template: str | None  # experts: the name with "{expert}" open
    draft: bool = False  # Megatron's multi-token-prediction block (on the last pipeline stage)


_MEGATRON_SPLIT = {Shard.COLUMN: 0, Shard.KV_HEADS: 0, Shard.VOCAB: 0, Shard.ROW: 1}  # role -> TP dim; else whole
# Megatron parameters split over TP although engines replicate their HF tensor (megatron-core 0.16.1 builds
# MLA's latent down-projections and the MTP block's eh_proj column-parallel): name within a layer -> TP dim.
_MEGATRON_SPLIT_IN_LAYER = {"self_attention.linear_q_down_proj.weight": 0,
                            "self_attention.linear_kv_down_proj.weight": 0, "eh_proj.weight": 0}


def _in_layer(template: str) -> str:
    """Return a rule's Megatron name within its layer (a main layer's, or the MTP block's decoder layer's)."""
    return template.split(".{layer}.", 1)[-1].removeprefix("transformer_layer.")


def megatron_tensors(converter: Any, tp: int) -> list[MegatronTensor]:
    """Return the Megatron parameters that produce `converter`'s HF checkpoint, in model order.

    Each HF tensor's producer is the first rule of the family's table that outputs it (a family
    lists the local-spec and Transformer-Engine namings side by side); a rule's outputs are
    concatenated on dim 0 (q/k/v, gate/up), a vocabulary padded as Megatron pads it for `tp`.
    The sharding follows the outputs' shard role (experts over ETP, gate/up with stride 2).
    `ScalePlanner` converts every one with `converter.convert_meta` (shapes checked against the HF
    config) and checks that together they produce exactly the checkpoint (`check_complete`).
    """
    hf = converter.expected_hf_tensors(quantized=False)
    main_layers = converter.config["num_hidden_layers"]
    groups: dict[str, tuple[Any, dict[str, int], list[str]]] = {}
    cache: dict = {}
    for name in hf:
        rule, captures = _producer(converter, name, cache, main_layers)
        megatron = rule.megatron_pattern.format(**captures)
        groups.setdefault(megatron, (rule, captures, []))[2].append(name)
    out = []
    for megatron, (rule, captures, names) in groups.items():
        layer = captures.get("layer")
        if rule.draft:  # the draft depth d is the checkpoint's layer num_hidden_layers + d
            layer += main_layers
        shapes = [hf[n][0] for n in names]
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        if rule.transform is vocab:
            shape = (_padded_vocab(shape[0], tp), *shape[1:])
        dim = _MEGATRON_SPLIT_IN_LAYER.get(_in_layer(rule.megatron), _MEGATRON_SPLIT.get(converter.shard_role(names[0])))
        expert = captures.get("expert")
        sharding = Split() if dim is None else Split("etp" if expert is not None else "tp", dim,
                                                           2 if rule.transform is gate_up else 1)
        template = None if expert is None else rule.megatron.replace("{layer}", str(captures["layer"]))
        out.append(MegatronTensor(megatron, shape, sharding, layer, expert, template, rule.draft))
    return out


def _producer(converter: Any, hf_name: str, cache: dict, main_layers: int):
    """Return (rule, captures in the rule's Megatron terms) of the first rule that outputs `hf_name`: a draft
    rule for a layer past the main ones (its depth is the layer minus `main_layers`), else a main one. Names
    that differ only in their indices share their rule (looked up once per such shape of name)."""
    layer = HF_LAYER.match(hf_name)
    draft = layer is not None and int(layer.group(1)) >= main_layers
    key = (_INDEX.sub("#", hf_name), draft)
    found = cache.get(key)
    if found is None:
        found = cache[key] = next(
            ((rule, i) for rule in converter.family.rules if rule.draft == draft
             for i, pattern in enumerate(rule.hf_patterns)
             if (c := _megatron_captures(pattern, hf_name, draft, main_layers)) is not None
             and not converter.is_skipped(rule.megatron_pattern.format(**c))), None)
        if found is None:
            raise ValueError(f"no rule of family {converter.family.name!r} produces {hf_name}")
    rule, i = found
    return rule, _megatron_captures(rule.hf_patterns[i], hf_name, draft, main_layers)


def _megatron_captures(pattern: Any, hf_name: str, draft: bool, main_layers: int) -> dict[str, int] | None:
    captures = pattern.match(hf_name)
    if captures is not None and draft:
        captures["layer"] -= main_layers
    return captures


def _padded_vocab(rows: int, tp: int) -> int:
    step = _MAKE_VOCAB_DIVISIBLE_BY * tp
    return -(-rows // step) * step


def _stage_of_layers(num_layers: int, trainer: TrainerLayout) -> list[int]:
    """Return each layer's pipeline stage: with `first_layers` / `last_layers` (Megatron's
    --decoder-first/last-pipeline-num-layers) those stages hold that many and the others split the rest
    evenly; otherwise layers split as evenly as possible over pp*vpp virtual chunks (earlier chunks take
    the remainder), chunk c on stage c % pp (Megatron's interleaved schedule)."""
    pp, vpp = trainer.pp, trainer.vpp
    if trainer.first_layers or trainer.last_layers:
        return trainer.stage_layers(num_layers)
    chunks = pp * vpp
    base, extra = divmod(num_layers, chunks)
    stage = []
    for c in range(chunks):
        stage += [c % pp] * (base + (1 if c < extra else 0))
    return stage


def stage_units(converter: Any, trainer: TrainerLayout, train_dtype: torch.dtype) -> list[list[GatherUnit]]:
    """Return every pipeline stage's gather units (`plan_gather_units` over one rank's meta-device
    parameters: EP rank 0's local experts), skipped names removed, each in its gather dtype."""
    tensors = megatron_tensors(converter, trainer.tp)
    layers = 1 + max((t.layer for t in tensors if t.layer is not None and not t.draft), default=-1)
    stage_of = _stage_of_layers(layers, trainer)
    num_experts = 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)
    num_local = num_experts // trainer.ep if num_experts else 0
    if num_experts and num_experts % trainer.ep:
        raise ValueError(f"trainer.ep={trainer.ep} must divide the {num_experts} routed experts")
    per_stage: list[list[SourceTensor]] = [[] for _ in range(trainer.pp)]
    for t in tensors:
        stage = _stage_of_global(t, stage_of, trainer.pp)
        if t.expert is not None and t.expert >= num_local:
            continue  # EP rank 0 holds experts 0 .. num_local - 1
        local = list(t.shape)
        size = {"tp": trainer.tp, "etp": trainer.etp}.get(t.sharding.axis, 1)
        if local[t.sharding.dim] % size:
            raise ValueError(f"{t.name}: dim {t.sharding.dim} of {tuple(t.shape)} does not divide by "
                             f"{t.sharding.axis}={size}; pick a {t.sharding.axis} that divides it")
        local[t.sharding.dim] //= size
        slot = None if t.expert is None else ExpertSlot(t.layer, t.template, t.expert, num_local)
        meta = torch.empty(local, dtype=train_dtype, device="meta")
        per_stage[stage].append(SourceTensor(t.name, meta, t.sharding, slot))
    units = []
    dtypes: dict[tuple, torch.dtype] = {}  # an expert's index never changes its rule: ask once per layer and kind
    for stage, stage_tensors in enumerate(per_stage):
        layout = ParallelLayout.at(trainer, pp_rank=stage)
        stage_units_ = []
        for u in plan_gather_units(stage_tensors, layout):
            key = (_LOCAL_EXPERT.sub(r"\1#", u.name), u.dtype)
            if key not in dtypes:
                dtypes[key] = converter.gather_dtype(u.name, u.dtype)
            if not converter.is_skipped(u.name):
                stage_units_.append(u if dtypes[key] == u.dtype else replace(u, dtype=dtypes[key]))
        units.append(stage_units_)
    return units


def _stage_of_global(t: MegatronTensor, stage_of: list[int], pp: int) -> int:
    if t.draft:
        return pp - 1  # megatron-core puts the MTP block on the last pipeline stage
    if t.layer is not None:
        return stage_of[t.layer]
    return 0 if t.name.startswith("embedding.") else pp - 1  # final norm and output layer: the last stage


def flows(unit: GatherUnit, stage: int, dst: int, t: TrainerLayout) -> list[tuple[int, int, int]]:
    """Return the (from rank, to rank, bytes) hops that bring `unit` whole to rank `dst`.

    Dense: the shards of dst's own TP group (tp is the fastest axis). Routed expert: its owner's ETP
    group (dst's expert-DP replica when dst is of that EP rank, else the first); a destination outside
    that group (the stage source of the bucket transports) gets it from the owner's first rank.
    """
    me = t.rank_of(dst)
    if unit.owner_ep is None:
        size = t.tp if unit.sharding.axis == "tp" else 1
        group = [dst - me.tp + k for k in range(size)]
        return [(g, dst, unit.nbytes // size) for g in group if g != dst] if dst in group else []
    size = t.etp if unit.sharding.axis == "etp" else 1
    edp = me.edp if me.ep == unit.owner_ep else 0
    group = [t.stage_source(stage) + (edp * t.ep + unit.owner_ep) * t.etp + k for k in range(size)]
    if dst in group:
        return [(g, dst, unit.nbytes // size) for g in group if g != dst]
    owner = group[0]
    return [(g, owner, unit.nbytes // size) for g in group[1:]] + [(owner, dst, unit.nbytes)]
