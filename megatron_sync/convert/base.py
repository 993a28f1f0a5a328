"""The `Converter` that applies a model family's table (`convert/family.py`) to one tensor at a time.

A family is data: `Rule` rows mapping Megatron name patterns to HF name
patterns through a layout transform, and `HFTensor` rows describing the HF
checkpoint the HF config calls for. `Converter` binds a family to one HF
config, a target dtype and an explicit skip list, and checks every produced
name and shape against that description.

When the HF config has a `quantization_config`, the converter also
quantizes: every weight it selects (`megatron_sync.convert.quant`, among the rows marked
`linear`) leaves `convert` as the engine's quantized tensors (FP8 values and
`weight_scale_inv` / `weight_scale`, or INT4 `weight_packed`, `weight_scale`,
`weight_shape`), computed from the whole converted tensor. Every method that
names checkpoint tensors (`expected_hf_tensors`, `expected_metas`,
`convert_meta`, `check_complete`, `keep_together`, `shard_role`) then speaks
those names; `tensor_specs` says how engines cut a weight and its scales alike.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from typing import Any, Callable, Iterable

import torch

from megatron_sync.convert.errors import (
    ConfigError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError,
    UnmappedParameterError,
)
from megatron_sync.convert.family import (  # noqa: F401 (the rows' import path of earlier releases)
    _BUILTIN_LAYER_KINDS, ConfigPredicate, Family, HFTensor, Rule, Skip, Transform, keep_together_of, tied, untied,
)
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.layout import REARRANGING_TRANSFORMS
from megatron_sync.convert.patterns import compile_pattern
from megatron_sync.convert.quant import DEFAULT_UNQUANTIZED, QuantPlan
from megatron_sync.convert.quant.plan import output_weight
from megatron_sync.layout.regions import Shard, TensorSpec
from megatron_sync.core.meta import TensorMeta

_MAX_LISTED = 8


class Converter:
    """Converts full Megatron tensors of one model family to HF checkpoint-format tensors (quantized
    where the HF config's `quantization_config` says).

    Draft layers (multi-token prediction): with `draft=True` the checkpoint holds the draft layers the
    HF config declares (the family's `draft_layers_key`, e.g. `num_nextn_predict_layers`), and Megatron's
    MTP block converts into them. `draft=False` says the engines hold no draft: the layout has no draft
    layers and every draft row's Megatron name is skipped, explicitly (the MTP block is not sent).
    """

    def __init__(self, family: Family, hf_config: Any, *, dtype: torch.dtype = torch.bfloat16,
                 skip: Iterable[str] = (), draft: bool = True):
        self.family = family
        self.config = HFConfig(hf_config, family.name)
        self.dtype = dtype
        if family.validate_config is not None:
            family.validate_config(self.config)
        self.draft = draft
        self.draft_layers = self._draft_layers()
        active = [s.megatron for s in family.skip if s.when is None or s.when(self.config)]
        if not draft:
            active += [r.megatron for r in family.rules if r.draft]
        skip = (skip,) if isinstance(skip, str) else tuple(skip)
        self.skip: tuple[str, ...] = tuple(dict.fromkeys([*active, *skip]))
        self._skip_patterns = tuple(compile_pattern(s) for s in self.skip)
        self.buffer_patterns: tuple[str, ...] = family.buffers
        self._hf_dtypes = {h: r.dtype or dtype for r in family.rules for h in r.hf}
        self._rule_of: dict[str, tuple[Rule, dict[str, int]]] = {}
        self._expected = self._expected_layout()
        self.quant, self._stored = self._quantized_layout()

    # -- the HF side, from the config alone -------------------------------------------------

    def _draft_layers(self) -> int:
        """Return how many draft layers the checkpoint holds: the config's count, 0 without a draft."""
        key = self.family.draft_layers_key
        if key is None or not self.draft:
            return 0
        count = self.config.get(key) or 0
        if not isinstance(count, int) or count < 0:
            raise ConfigError(f"{key}={count!r} in the HF config of family {self.family.name!r} must be a "
                              f"count of draft layers (0 or more)")
        return count

    def _layer_kind_ok(self, row: HFTensor, layer: int) -> bool:
        extra = dict(self.family.layer_kinds)
        if row.layers in extra:
            return extra[row.layers](self.config, layer)
        return _BUILTIN_LAYER_KINDS[row.layers](self.family, self.config, layer)

    def _row_names(self, row: HFTensor, layer: int | None) -> list[str]:
        pattern = compile_pattern(row.name)
        if layer is not None and not self._layer_kind_ok(row, layer):
            return []
        if "expert" not in pattern.fields:
            return [pattern.format(layer=layer)]
        experts = range(self.config[self.family.num_experts_key])
        return [pattern.format(layer=layer, expert=e) for e in experts]

    def _expected_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, HFTensor]]:
        """Global tensors first, then layer by layer in table order, experts innermost; the draft
        layers (each a whole decoder layer plus its draft-only rows) after the main ones."""
        rows = [r for r in self.family.hf_tensors if r.when is None or r.when(self.config)]
        per_layer = [r for r in rows if "layer" in compile_pattern(r.name).fields]
        ordered = [(r, None) for r in rows if r not in per_layer]
        main = self.config["num_hidden_layers"]
        ordered += [(r, i) for i in range(main) for r in per_layer if r.layers != "draft"]
        ordered += [(r, i) for i in range(main, main + self.draft_layers) for r in per_layer]
        expected = {}
        for row, layer in ordered:
            assert row.name in self._hf_dtypes, f"{self.family.name}: no rule produces {row.name}"
            shape = tuple(self.config.eval(e) for e in row.shape)
            for name in self._row_names(row, layer):
                expected[name] = (shape, self._hf_dtypes[row.name], row)
        return expected

    def _quantized_layout(self) -> tuple[QuantPlan, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """Return the plan of the HF config's `quantization_config` over this layout (empty without one)
        and the checkpoint layout it gives; a weight the config cannot quantize fails here, by name."""
        quantization_config = self.config.get("quantization_config")
        linear = {name for name, (_, _, row) in self._expected.items() if row.linear}
        try:
            plan = (QuantPlan({}) if quantization_config is None else
                    QuantPlan.from_hf_config(quantization_config, self._expected, linear.__contains__))
            return plan, plan.expected_layout(self.expected_hf_tensors(quantized=False))
        except ValueError as e:
            raise ConfigError(f"family {self.family.name!r}: {e}") from None

    def expected_hf_tensors(self, quantized: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Return every HF tensor a complete checkpoint holds: name -> (shape, dtype), from the config alone.

        `quantized=False` gives the tensors an engine computes with instead: each quantized weight
        under its own name, shape and the converter's dtype (what its values and scales dequantize to).
        """
        if quantized:
            return dict(self._stored)
        return {name: (shape, dtype) for name, (shape, dtype, _) in self._expected.items()}

    def expected_metas(self, quantized: bool = True) -> list[TensorMeta]:
        """Return the HF checkpoint's tensors as metadata, in `expected_hf_tensors` order."""
        return [TensorMeta(name, shape, dtype) for name, (shape, dtype) in self.expected_hf_tensors(quantized).items()]

    def weight_of(self, hf_name: str) -> str:
        """Return the HF weight that checkpoint tensor `hf_name` holds part of: the weight a quantized
        value, scale or shape tensor belongs to, else `hf_name` itself."""
        return self.quant.weight_of(hf_name) or hf_name

    def shard_role(self, hf_name: str) -> Shard:
        """Return how engines split HF tensor `hf_name` over their TP ranks (its row's `shard`).

        A quantized weight's values and scales have their weight's role (`tensor_specs` says how they are cut).
        """
        try:
            return self._expected[self.weight_of(hf_name)][2].shard
        except KeyError:
            raise UnexpectedTensorError(
                f"{hf_name!r} is not a tensor of family {self.family.name!r} under this HF config: "
                f"{self._why_unexpected(hf_name)}"
            ) from None

    def tensor_specs(self) -> list[TensorSpec]:
        """Return every HF checkpoint tensor, in `expected_metas` order, with how engines shard it: its
        weight's role, and for a quantized weight's part how a slice of the weight maps onto it."""
        specs = []
        for name, (shape, dtype, row) in self._expected.items():
            expert = compile_pattern(row.name).match(name).get("expert")
            specs.extend(dataclasses.replace(spec, expert=expert)
                         for spec in self.quant.specs(name, shape, dtype, row.shard))
        return specs

    @property
    def keep_together(self) -> tuple[tuple[str, ...], ...]:
        """The groups of HF name patterns that must share a bucket: the family's, and each quantized
        weight's values with its scales (see `keep_together_of`)."""
        return keep_together_of(self.family, self._stored)

    # -- the Megatron side --------------------------------------------------------------------

    def is_skipped(self, megatron_name: str) -> bool:
        """Return True if `megatron_name` is in the explicit skip list (family skips + user skips)."""
        return any(p.match(megatron_name) is not None for p in self._skip_patterns)

    def is_buffer(self, megatron_name: str) -> bool:
        """Return True if `megatron_name` is a Megatron buffer (not a parameter) that must be sent."""
        return any(compile_pattern(b).match(megatron_name) is not None for b in self.buffer_patterns)

    def _find_rule(self, megatron_name: str) -> tuple[Rule, dict[str, int]]:
        found = self._rule_of.get(megatron_name)  # every sync converts the same names: match each once
        if found is not None:
            return found
        for rule in self.family.rules:
            captures = rule.megatron_pattern.match(megatron_name)
            if captures is not None:
                self._rule_of[megatron_name] = rule, captures
                return rule, captures
        raise UnmappedParameterError(
            f"no rule for {megatron_name!r} in family {self.family.name!r}; add a Rule to "
            f"megatron_sync.convert/{self.family.name}.py or list it in skip=(...{megatron_name!r}...)"
        )

    def convert(self, megatron_name: str, tensor: torch.Tensor,
                into: Callable[[str], torch.Tensor | None] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Return the HF checkpoint (name, tensor) pairs for one full Megatron tensor; [] if it is skipped.

        Outputs are contiguous and in the rule's dtype; they may share storage with `tensor`. A weight
        the quantization_config selects comes out as its quantized tensors, computed from the whole
        tensor (so a block never straddles training shards), its scales right after its values.
        `into(hf_name)` may return a destination for an unquantized output (its final shape and
        dtype, e.g. its slot in a bucket): the output is then written there in one copy (layout and
        cast together) and the destination is returned in its place.
        """
        plain = None if into is None else (lambda name: into(name) if self.quant.scheme_of(name) is None else None)
        return [out for name, t in self._convert_unquantized(megatron_name, tensor, plain)
                for out in self.quant.quantize(name, t)]

    def _convert_unquantized(self, megatron_name: str, tensor: torch.Tensor,
                             into: Callable[[str], torch.Tensor | None] | None = None
                             ) -> list[tuple[str, torch.Tensor]]:
        if self.is_skipped(megatron_name):
            return []
        rule, captures = self._find_rule(megatron_name)
        outputs = rule.transform(tensor, self.config)
        assert len(outputs) == len(rule.hf), f"{rule.megatron}: transform arity != len(hf)"
        if rule.draft:  # draft depth d is the checkpoint's layer num_hidden_layers + d
            captures = {**captures, "layer": self.config["num_hidden_layers"] + captures["layer"]}
        converted = []
        for pattern, out in zip(rule.hf_patterns, outputs):
            hf_name = pattern.format(**captures)
            self._check_produced(hf_name, tuple(out.shape), megatron_name)
            dtype = rule.dtype or self.dtype
            dest = into(hf_name) if into is not None else None
            if dest is not None and dest.shape == out.shape and dest.dtype == dtype:
                dest.copy_(out, non_blocking=True)
                converted.append((hf_name, dest))
            else:
                converted.append((hf_name, out.to(dtype).contiguous()))
        return converted

    def gather_dtype(self, megatron_name: str, dtype: torch.dtype) -> torch.dtype:
        """Return the dtype a Megatron tensor of `dtype` may be gathered in without changing what `convert`
        produces: its rule's output dtype when the rule only moves elements and that dtype is narrower
        (fp32 parameters sent as bf16 move half the bytes; a quantized weight is quantized from that
        dtype either way), else `dtype`."""
        if self.is_skipped(megatron_name):
            return dtype
        rule, _ = self._find_rule(megatron_name)
        out = rule.dtype or self.dtype
        narrower = out.is_floating_point and dtype.is_floating_point and out.itemsize < dtype.itemsize
        return out if narrower and rule.transform in REARRANGING_TRANSFORMS else dtype

    def convert_meta(self, megatron_name: str, shape: Iterable[int], dtype: torch.dtype) -> list[TensorMeta]:
        """Return the metadata `convert` would produce for a tensor of this shape and dtype, without data."""
        fake = torch.empty(tuple(shape), dtype=dtype, device="meta")
        return [meta for name, t in self._convert_unquantized(megatron_name, fake)
                for meta in self.quant.outputs(name, t.shape, t.dtype)]

    # -- checks ---------------------------------------------------------------------------

    def _check_produced(self, hf_name: str, shape: tuple[int, ...], megatron_name: str) -> None:
        if hf_name not in self._expected:
            raise UnexpectedTensorError(
                f"{megatron_name!r} produced {hf_name!r}, which the HF config of family "
                f"{self.family.name!r} does not call for: {self._why_unexpected(hf_name)}"
            )
        expected, _, row = self._expected[hf_name]
        if shape != expected:
            raise ShapeMismatchError(self._shape_message(hf_name, megatron_name, shape, expected, row))

    def _why_unexpected(self, hf_name: str) -> str:
        cfg = self.config
        weight = output_weight(hf_name)
        if weight is not None and weight in self._expected:
            scheme = self.quant.scheme_of(weight)
            if scheme is None:
                if cfg.get("quantization_config") is None:
                    why = "the HF config has no quantization_config"
                elif any(compile_pattern(p).match(weight) for p in DEFAULT_UNQUANTIZED):
                    why = "published quantized checkpoints keep it unquantized (megatron_sync.convert.quant.DEFAULT_UNQUANTIZED)"
                else:
                    why = "the quantization_config's targets and ignore list do not select it"
                return (f"{weight} is not quantized: {why}; make quantization_config match the engine's "
                        f"checkpoint")
            return (f"{weight} is quantized as {scheme}, stored as {list(scheme.output_names(weight))}; "
                    f"fix quantization_config to match the engine's checkpoint")
        for row in self.family.hf_tensors:
            captures = compile_pattern(row.name).match(hf_name)
            if captures is None:
                continue
            if row.when is not None and not row.when(cfg):
                return (f"the config disables it ({row.when.__name__}: {row.when.__doc__ or 'a config predicate'}); "
                        f"fix the HF config or add the Megatron name to skip=")
            if self.family.draft_layers_key and captures.get("layer", 0) >= cfg["num_hidden_layers"]:
                return self._why_no_draft_layer(captures["layer"])
            if captures.get("layer", 0) >= cfg["num_hidden_layers"]:
                return (f"layer {captures['layer']} >= num_hidden_layers={cfg['num_hidden_layers']}; "
                        f"fix num_hidden_layers in the HF config")
            key = self.family.num_experts_key
            if captures.get("expert", 0) >= (cfg.get(key) or 0):
                return f"expert {captures['expert']} >= {key}={cfg.get(key)}; fix {key} in the HF config"
            if not self._layer_kind_ok(row, captures["layer"]):
                keys = ", ".join(f"{k}={cfg.get(k)}" for k in self.family.layer_kind_keys)
                if row.layers not in ("moe", "dense"):
                    return (f"layer {captures['layer']} is not a {row.layers} layer per the config ({keys}); "
                            f"make those values match the Megatron model's layer pattern")
                kind = "MoE" if self.family.is_moe_layer(cfg, captures["layer"]) else "dense"
                return (f"layer {captures['layer']} is a {kind} layer per the config ({keys}); "
                        f"make those values match the Megatron model's MoE layer pattern")
        return "no HF layout row matches it (a bug in the family table)"

    def _why_no_draft_layer(self, layer: int) -> str:
        """Why HF layer `layer` (past the main layers) is not in this layout: no such draft layer."""
        key, main = self.family.draft_layers_key, self.config["num_hidden_layers"]
        if not self.draft:
            return (f"layer {layer} would be draft layer {layer - main}, but this converter was built with "
                    f"draft=False (weight_sync.draft: skip): the engines hold no draft")
        return (f"layer {layer} is draft (multi-token-prediction) layer {layer - main}, but the HF config has "
                f"{key}={self.config.get(key)}; set {key} in config.json to the Megatron model's mtp_num_layers "
                f"(and serve the draft), or set weight_sync.draft: skip when the engines run without it")

    def _shape_message(self, hf_name, megatron_name, shape, expected, row: HFTensor) -> str:
        parts = []
        for dim, (got, want, expr) in enumerate(zip(shape, expected, row.shape)):
            if got != want:
                names = sorted({n.id for n in ast.walk(ast.parse(expr)) if isinstance(n, ast.Name)})
                values = ", ".join(f"{n}={self.config.get(n)}" for n in names)
                parts.append(f"dim {dim} is {got} but {expr} = {want} ({values})")
        if len(shape) != len(expected):
            parts.append(f"rank {len(shape)} but the HF layout has rank {len(expected)}")
        return (f"{hf_name!r} (from {megatron_name!r}) has shape {shape}, but the HF config of "
                f"family {self.family.name!r} gives {expected}: {'; '.join(parts)}. "
                f"Make these HF config values match the Megatron model")

    def check_complete(self, produced_names: Iterable[str]) -> None:
        """Raise unless `produced_names` is exactly the expected HF name set, each name once."""
        counts = Counter(produced_names)
        twice = sorted(n for n, c in counts.items() if c > 1)
        unexpected = sorted(n for n in counts if n not in self._stored)
        missing = sorted(n for n in self._stored if n not in counts)
        if missing:
            raise MissingTensorError(
                f"{len(missing)} HF tensor(s) of family {self.family.name!r} were never produced: "
                f"{self._listing(missing)}; make sure every Megatron parameter (all pipeline stages, "
                f"all experts) and every buffer in buffer_patterns {list(self.buffer_patterns)} is "
                f"converted, and that nothing needed is in skip={list(self.skip)}{self._draft_hint(missing)}"
            )
        if unexpected:
            raise UnexpectedTensorError(
                f"{len(unexpected)} produced HF tensor(s) are not in the HF config's layout for family "
                f"{self.family.name!r}: {self._listing(unexpected)} ({self._why_unexpected(unexpected[0])}); "
                f"fix the HF config or skip their sources"
            )
        if twice:
            raise UnexpectedTensorError(
                f"HF tensor(s) produced more than once: {self._listing(twice)}; two Megatron names map to "
                f"each (e.g. both a TE fused and a separate layernorm); skip one of them"
            )

    def _draft_hint(self, missing: list[str]) -> str:
        """Return what to do when draft-layer tensors are missing (the Megatron model has no MTP block)."""
        first_draft = self.config["num_hidden_layers"]
        in_draft = [n for n in missing
                    if (compile_pattern(self._expected[self.weight_of(n)][2].name).match(self.weight_of(n)) or {}
                        ).get("layer", -1) >= first_draft]
        if not in_draft:
            return ""
        key = self.family.draft_layers_key
        return (f". {len(in_draft)} of them belong to the {self.draft_layers} draft (multi-token-prediction) "
                f"layer(s) the HF config declares ({key}={self.config.get(key)}): build the Megatron model with "
                f"mtp_num_layers={self.draft_layers}, or, when the engines run without the draft, set "
                f"weight_sync.draft: skip (or {key}: 0 in the engines' config.json)")

    def _listing(self, names: list[str]) -> str:
        shown = []
        for name in names[:_MAX_LISTED]:
            weight = self.weight_of(name)
            sources = [r.megatron for r in self.family.rules
                       for h in r.hf if compile_pattern(h).match(weight) is not None]
            part = f"part of quantized {weight}, " if weight != name else ""
            shown.append(f"{name} ({part}from {' or '.join(sources)})" if sources else name)
        more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
        return ", ".join(shown) + more


__all__ = ["Rule", "HFTensor", "Shard", "Skip", "Family", "Converter", "ConfigError", "keep_together_of",
           "tied", "untied"]
