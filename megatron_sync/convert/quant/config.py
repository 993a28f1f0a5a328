"""Read an HF `quantization_config` into schemes, and pick which HF weights each scheme quantizes.

Supported configs (anything else raises ValueError naming the key and the supported values):
- `quant_method: fp8` (vLLM's `Fp8Config`, transformers' `FineGrainedFP8Config`):
  `weight_block_size: [bo, bi]` gives `Fp8Block` (with `scale_fmt` "float" or
  "ue8m0"); no `weight_block_size` gives `Fp8Tensor`, as in vLLM (transformers
  would default a missing key to [128, 128]; write the key to be unambiguous).
  Every Linear is quantized except modules named *exactly* in
  `ignored_layers` / `modules_to_not_convert` (vLLM's "exact" match mode;
  transformers also accepts prefixes and suffixes there), and, as vLLM does,
  a layer's routed experts are one module: an entry naming any of them keeps
  all of that layer's experts unquantized.
- `quant_method: compressed-tensors` with `format: pack-quantized` and
  symmetric int4 group weights without activation quantization (W4A16):
  `Int4Group`. A Linear module is quantized by the first config group whose `targets`
  name it (exact name or `re:` regex, `re.match` semantics, as
  compressed-tensors' `match_name`), else by the first group targeting the
  `Linear` class, unless an `ignore` entry matches it the same way.

Whatever the config says, the weights in `DEFAULT_UNQUANTIZED` stay in the
model dtype: embeddings, lm_head, the MoE router gate and DeepSeek's
`e_score_correction_bias`, as in the published FP8 / INT4 checkpoints of
every supported family (norms and biases are not Linear weights at all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Union

from megatron_sync.convert.patterns import compile_pattern
from megatron_sync.convert.quant.fp8 import SCALE_FORMATS, Fp8Block, Fp8Tensor
from megatron_sync.convert.quant.int4 import Int4Group

QuantScheme = Union[Fp8Block, Fp8Tensor, Int4Group]
IsLinearWeight = Callable[[str], bool]

DEFAULT_UNQUANTIZED = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.{layer}.mlp.gate.weight",
    "model.layers.{layer}.mlp.gate.e_score_correction_bias",
)
LINEAR = "Linear"


@dataclass(frozen=True)
class TargetGroup:
    """One config group: the target entries (names, `re:` regexes, or the class `Linear`) and its scheme."""

    targets: tuple[str, ...]
    scheme: QuantScheme


@dataclass(frozen=True)
class QuantConfig:
    """A parsed `quantization_config`: its method, target groups in order, and ignore entries."""

    method: str
    groups: tuple[TargetGroup, ...]
    ignore: tuple[str, ...] = ()


def _get(cfg: Mapping[str, Any], key: str, supported: Iterable[Any], default: Any = None, where: str = "") -> Any:
    value = cfg.get(key, default)
    if value not in supported:
        raise ValueError(f"quantization_config.{where}{key}={value!r} is not supported; "
                         f"use one of {list(supported)}")
    return value


def _check_entries(where: str, entries: Any) -> tuple[str, ...]:
    if entries is None:
        return ()
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"quantization_config.{where} must be a list of strings, got {entries!r}")
    for entry in entries:
        if entry[:1].isupper() and "." not in entry and entry != LINEAR:
            raise ValueError(
                f"quantization_config.{where} entry {entry!r} names a module class; only {LINEAR!r} is "
                f"supported as a class, use module names or 're:' regexes for the rest"
            )
        if entry.startswith("re:"):
            re.compile(entry[3:])
    return tuple(entries)


def _parse_fp8(cfg: Mapping[str, Any]) -> QuantConfig:
    _get(cfg, "fmt", ("e4m3",), "e4m3")
    _get(cfg, "activation_scheme", ("dynamic",), "dynamic")
    _get(cfg, "store_dtype", (None,))
    scale_fmt = _get(cfg, "scale_fmt", SCALE_FORMATS, "float")
    block = cfg.get("weight_block_size")
    if block is None:
        _get(cfg, "scale_fmt", ("float",), "float")  # UE8M0 is a block-scale format
        scheme: QuantScheme = Fp8Tensor()
    else:
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {block!r}")
        scheme = Fp8Block(tuple(block), scale_fmt)
    ignore = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert")
    ignore = _check_entries("modules_to_not_convert", ignore)
    regex = [e for e in ignore if e.startswith("re:")]
    if regex:
        raise ValueError(f"quantization_config.modules_to_not_convert entries {regex} are regexes; quant_method "
                         f"fp8 matches exact module names there (as vLLM does), list the modules by name")
    return QuantConfig("fp8", (TargetGroup((LINEAR,), scheme),), ignore)


# compressed-tensors weight arguments this module implements: key -> (supported values, default)
_INT4_WEIGHTS = {
    "num_bits": ((4,), None), "type": (("int",), "int"), "symmetric": ((True,), True),
    "strategy": (("group", None), None), "dynamic": ((False,), False),
    "actorder": ((None, False, "weight", "static"), None),  # "group" needs g_idx: not supported
}


def _parse_ct_weights(name: str, group: Mapping[str, Any]) -> Int4Group:
    where = f"config_groups.{name}."
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"quantization_config.{where}{key} must be null: only weight-only INT4 "
                             f"(W4A16) is supported")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ValueError(f"quantization_config.{where}weights must be a mapping, got {weights!r}")
    for key, (supported, default) in _INT4_WEIGHTS.items():
        _get(weights, key, supported, default, where + "weights.")
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"quantization_config.{where}weights.group_size must be a positive int, got {size!r}")
    return Int4Group(size)


def _parse_compressed_tensors(cfg: Mapping[str, Any]) -> QuantConfig:
    _get(cfg, "quantization_status", ("compressed", None))
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if cfg.get(key):
            raise ValueError(f"quantization_config.{key} is not supported; it must be null")
    top_format = _get(cfg, "format", ("pack-quantized", None))
    raw_groups = cfg.get("config_groups")
    if not isinstance(raw_groups, Mapping) or not raw_groups:
        raise ValueError("quantization_config.config_groups must be a non-empty mapping of groups")
    groups = []
    for name, group in raw_groups.items():
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise ValueError(f"quantization_config.config_groups.{name}.format={fmt!r} is not supported; "
                             f"use 'pack-quantized'")
        targets = _check_entries(f"config_groups.{name}.targets", group.get("targets"))
        groups.append(TargetGroup(targets, _parse_ct_weights(name, group)))
    return QuantConfig("compressed-tensors", tuple(groups), _check_entries("ignore", cfg.get("ignore")))


_PARSERS = {"fp8": _parse_fp8, "compressed-tensors": _parse_compressed_tensors}


def parse_quantization_config(cfg: Any) -> QuantConfig:
    """Return the `QuantConfig` of an HF `quantization_config` (dict, or an object with `to_dict()`)."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if method not in _PARSERS:
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported; "
                         f"use one of {list(_PARSERS)}")
    return _PARSERS[method](cfg)


def _matches(module: str, entry: str) -> bool:
    if entry == LINEAR:
        return True  # callers only ask about Linear modules
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


# vLLM builds a layer's routed experts as one module, "model.layers.{L}.mlp.experts": its fp8 method skips
# quantizing all of them when any ignore entry naming experts contains that module's name as a substring
# (`is_layer_skipped`, exact mode), so ignoring one expert's projection leaves the whole layer's experts
# unquantized (and, as in vLLM, "...layers.1.mlp.experts" is a substring of "...layers.11.mlp.experts.0...").
_ROUTED_EXPERT = re.compile(r"(?P<module>.+\.mlp\.experts)\.\d+\.[^.]+")
# vLLM fuses these sibling projections into one module; all must share one scheme (it refuses a mix).
_FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _ignored(module: str, config: QuantConfig) -> bool:
    expert = _ROUTED_EXPERT.fullmatch(module)
    if expert is not None and config.method == "fp8":
        return any(expert["module"] in entry for entry in config.ignore if "experts" in entry)
    return any(_matches(module, e) for e in config.ignore)


def _scheme_for(module: str, linear: bool, config: QuantConfig) -> QuantScheme | None:
    if not linear:  # engines quantize Linear layers only, whatever a regex target matches
        return None
    if _ignored(module, config):
        return None
    for by_name in (True, False):  # a name or regex target wins over the class target
        for group in config.groups:
            if any((t == LINEAR) != by_name and _matches(module, t) for t in group.targets):
                return group.scheme
    return None


def _check_fused_siblings(names: Iterable[str], selected: Mapping[str, QuantScheme]) -> None:
    """Raise ValueError when projections vLLM fuses into one module (q/k/v, gate/up) would get different
    schemes: vLLM refuses such a checkpoint ("all shards of fused layers must have the same precision")."""
    present = set(names)
    for siblings in _FUSED_SIBLINGS:
        for name in present:
            parent, _, leaf = name.removesuffix(".weight").rpartition(".")
            if leaf != siblings[0]:
                continue
            members = [f"{parent}.{s}.weight" for s in siblings if f"{parent}.{s}.weight" in present]
            schemes = {m: selected.get(m) for m in members}
            if len(set(map(repr, schemes.values()))) > 1:
                raise ValueError(
                    f"quantization_config quantizes the projections vLLM fuses into one module differently: "
                    f"{ {m: (str(s) if s else 'unquantized') for m, s in schemes.items()} }; vLLM requires one "
                    f"scheme for all of {list(siblings)}: list all or none of them in the ignore list")


def select_targets(config: QuantConfig, hf_names: Iterable[str], is_linear_weight: IsLinearWeight, *,
                   keep_unquantized: Iterable[str] = DEFAULT_UNQUANTIZED) -> dict[str, QuantScheme]:
    """Return {hf weight name: scheme} for the weights `config` quantizes, in `hf_names` order.

    `is_linear_weight(name)` says whether an HF weight belongs to a Linear
    module; `keep_unquantized` holds name patterns (`{layer}`/`{expert}`
    grammar, whole-name match) that are never quantized. Ignore entries apply
    as vLLM applies them (routed experts per layer; fused projections alike).
    """
    keep = [compile_pattern(p) for p in keep_unquantized]
    names = list(hf_names)
    selected = {}
    for name in names:
        if not name.endswith(".weight") or any(p.match(name) is not None for p in keep):
            continue
        scheme = _scheme_for(name[: -len(".weight")], bool(is_linear_weight(name)), config)
        if scheme is not None:
            selected[name] = scheme
    _check_fused_siblings(names, selected)
    return selected
