"""A read-only view of an HF config, from a `PretrainedConfig` or a config.json dict."""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

from megatron_sync.convert.errors import ConfigError

# config.json spellings that transformers renames through `attribute_map`.
_ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",)}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv}


class HFConfig:
    """Config values by name, with the defaults HF modeling code derives (head_dim, kv heads)."""

    def __init__(self, config: Any, family: str = "?"):
        if isinstance(config, HFConfig):
            config = config._values
        if isinstance(config, Mapping):
            values = dict(config)
        elif hasattr(config, "to_dict"):
            values = config.to_dict()
            # `to_dict` omits attribute_map aliases and some derived attributes.
            for key in ("head_dim", "num_experts", "tie_word_embeddings"):
                if values.get(key) is None and getattr(config, key, None) is not None:
                    values[key] = getattr(config, key)
        else:
            raise ConfigError(
                f"hf_config must be a transformers PretrainedConfig or a dict of config.json, "
                f"got {type(config).__name__}"
            )
        self._values = values
        self.family = family
        self._derive_defaults()

    def _derive_defaults(self) -> None:
        v = self._values
        if v.get("num_key_value_heads") is None and v.get("num_attention_heads") is not None:
            v["num_key_value_heads"] = v["num_attention_heads"]
        if v.get("head_dim") is None and v.get("num_attention_heads"):
            v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
        if v.get("tie_word_embeddings") is None:
            v["tie_word_embeddings"] = False

    def get(self, key: str, default: Any = None) -> Any:
        """Return config value `key` (or an alias of it), else `default`."""
        for k in (key, *_ALIASES.get(key, ())):
            if self._values.get(k) is not None:
                return self._values[k]
        return default

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(
                f"HF config for family {self.family!r} has no value for {key!r}; "
                f"set {key} in the config (config.json)"
            )
        return value

    def eval(self, expr: str) -> int:
        """Return the integer value of `expr`, an arithmetic expression over config names."""
        return _eval(ast.parse(expr, mode="eval").body, self)


def _eval(node: ast.AST, cfg: HFConfig) -> int:
    if isinstance(node, ast.Name):
        return int(cfg[node.id])
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, cfg), _eval(node.right, cfg))
    raise ValueError(f"unsupported shape expression {ast.unparse(node)!r}")
