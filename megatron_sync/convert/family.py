"""A model family as data: `Rule` rows mapping Megatron name patterns to HF name patterns through a layout
transform, `HFTensor` rows describing the HF checkpoint the HF config calls for, `Skip` rows, and the `Family`
that holds them (`megatron_sync.convert.base.Converter` applies one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.layout import rename
from megatron_sync.convert.patterns import Pattern, compile_pattern
from megatron_sync.convert.quant import output_groups
from megatron_sync.layout.regions import Shard

Transform = Callable[[torch.Tensor, HFConfig], tuple[torch.Tensor, ...]]
ConfigPredicate = Callable[[HFConfig], bool]


@dataclass(frozen=True)
class Rule:
    """One row: Megatron name pattern -> HF name pattern(s), through `transform`, cast to `dtype`.

    `transform(tensor, hf_config)` returns one tensor per HF pattern, in order.
    `dtype=None` means the converter's target dtype; set it to keep, e.g., float32.
    `draft=True` marks a row of the multi-token-prediction draft (megatron_sync.convert/mtp.py): its Megatron
    `{layer}` is the draft depth d, and its HF names carry layer `num_hidden_layers + d`.
    """

    megatron: str
    hf: str | tuple[str, ...]
    transform: Transform = rename
    dtype: torch.dtype | None = None
    draft: bool = False

    def __post_init__(self):
        hf = (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)
        object.__setattr__(self, "hf", hf)
        source = compile_pattern(self.megatron)
        if self.draft and "layer" not in source.fields:
            raise ValueError(f"draft rule {self.megatron!r} must capture the draft depth as {{layer}}")
        for target in hf:
            extra = set(compile_pattern(target).fields) - set(source.fields)
            if extra:
                raise ValueError(f"rule {self.megatron!r} -> {target!r}: {sorted(extra)} not captured")

    @property
    def megatron_pattern(self) -> Pattern:
        return compile_pattern(self.megatron)

    @property
    def hf_patterns(self) -> tuple[Pattern, ...]:
        return tuple(compile_pattern(h) for h in self.hf)


@dataclass(frozen=True)
class HFTensor:
    """One row of the HF checkpoint layout: name pattern, shape as config expressions, how engines
    shard it, and where it exists.

    `layers` is "all", "dense", "moe", "draft" (only the multi-token-prediction draft layers hold it) or a
    kind the family defines in `layer_kinds` (for `{layer}` patterns: the layers where the tensor exists;
    every kind but "draft" applies to main and draft layers alike); `when` is an
    optional predicate on the config (e.g. lm_head only when embeddings are untied).
    `linear` says whether engines build the tensor as a Linear layer's weight,
    the only kind a `quantization_config` may quantize (its "Linear" targets);
    the default is every 2-D `.weight` row, so only an embedding says False.
    """

    name: str
    shape: tuple[str, ...]
    shard: Shard | None = None
    layers: str = "all"
    when: ConfigPredicate | None = None
    linear: bool | None = None

    def __post_init__(self):
        if not isinstance(self.shard, Shard):
            raise ValueError(f"HFTensor {self.name!r}: say how engines shard it (shard=Shard.<role>)")
        if self.linear is None:
            object.__setattr__(self, "linear", len(self.shape) == 2 and self.name.endswith(".weight"))


@dataclass(frozen=True)
class Skip:
    """A Megatron name pattern that is known and deliberately not sent, with the reason."""

    megatron: str
    reason: str
    when: ConfigPredicate | None = None


def _never(cfg: HFConfig, layer: int) -> bool:
    return False


LayerPredicate = Callable[[HFConfig, int], bool]

# The layer kinds every family has: (family, config, layer index) -> does the layer have this kind.
_BUILTIN_LAYER_KINDS = {
    "all": lambda family, cfg, layer: True,
    "moe": lambda family, cfg, layer: family.is_moe_layer(cfg, layer),
    "dense": lambda family, cfg, layer: not family.is_moe_layer(cfg, layer),
    "draft": lambda family, cfg, layer: layer >= cfg["num_hidden_layers"],
}


@dataclass(frozen=True)
class Family:
    """A model family, in one place: its rule table, its HF layout (with each tensor's shard role),
    which tensors must share a bucket, and the config facts the tables depend on.

    `hf_model_types` are the `model_type` values of the HF configs this family
    converts (engines pick the family of a model directory by it);
    `draft_layers_key` names the HF config value counting the multi-token-prediction
    draft layers the checkpoint holds after the main ones (None: the family has none);
    `keep_together` lists groups of HF name patterns that must arrive in one
    bucket, a group's members with equal `{layer}` sharing it (an engine fuses
    them at load). `layer_kinds` names further kinds of layer an `HFTensor.layers`
    may say (a hybrid model's linear- and full-attention layers), each with the
    config test that picks its layers.
    """

    name: str
    rules: tuple[Rule, ...]
    hf_tensors: tuple[HFTensor, ...]
    skip: tuple[Skip, ...] = ()
    buffers: tuple[str, ...] = ()
    is_moe_layer: Callable[[HFConfig, int], bool] = _never
    num_experts_key: str = "num_experts"
    validate_config: Callable[[HFConfig], None] | None = None
    layer_kind_keys: tuple[str, ...] = ()
    keep_together: tuple[tuple[str, ...], ...] = ()
    hf_model_types: tuple[str, ...] = ()
    layer_kinds: tuple[tuple[str, LayerPredicate], ...] = ()
    draft_layers_key: str | None = None

    def __post_init__(self):
        if not self.hf_model_types:
            object.__setattr__(self, "hf_model_types", (self.name,))
        kinds = {*_BUILTIN_LAYER_KINDS, *dict(self.layer_kinds)}
        for row in self.hf_tensors:
            if row.layers not in kinds:
                raise ValueError(f"HFTensor {row.name!r} of family {self.name!r}: layers={row.layers!r} is "
                                 f"none of {sorted(kinds)}; add it to the family's layer_kinds")
        for group in self.keep_together:
            for pattern in group:
                compile_pattern(pattern)  # a typo fails at import, not mid-sync


def keep_together_of(family: Family, hf_names: Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """Return the groups of HF names (patterns) that must share a bucket in a checkpoint of `family` with
    these tensor names: the family's groups, and one literal group per quantized weight (its values with
    their scales). Both sides of a sync compute it, the trainer from its converter and an engine from the
    names it expects, so both cut the same buckets."""
    return tuple(family.keep_together) + output_groups(hf_names)


def tied(cfg: HFConfig) -> bool:
    """True when the HF model ties lm_head to the input embedding."""
    return bool(cfg.get("tie_word_embeddings"))


def untied(cfg: HFConfig) -> bool:
    """True when the HF model has its own lm_head.weight."""
    return not tied(cfg)
