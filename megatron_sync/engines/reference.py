"""The reference inference engine: Hugging Face transformers on CPU with its own tensor parallelism.

Each engine rank builds the transformers model of the config's family on the
meta device, swaps its projections for tensor-parallel layers that hold only
this rank's shard, and only then allocates memory, so no rank ever holds the
full model. Sharding follows vLLM:

- column parallel (dim 0): q/k/v (by heads; GQA key/value heads replicated when
  TP exceeds them), MLA's q_b_proj / kv_b_proj, MLP and per-expert gate/up;
- row parallel (dim 1, outputs summed over the group): o_proj, MLP and
  per-expert down_proj;
- replicated: norms, MoE routers (and DeepSeek's e_score_correction_bias),
  MLA's low-rank down projections, and the embeddings and lm_head, so that
  every rank computes full-vocabulary logits without a gather.

The engine speaks the HF checkpoint format (what the trainer sends), with
per-expert names; transformers 5 keeps experts fused in memory
(`mlp.experts.gate_up_proj[e] = [gate_e; up_e]`), and the rule table says
where each per-expert tensor lives inside the fused one.
"""

from __future__ import annotations

import copy
import glob
import os
import re
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from megatron_sync.engines.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    all_reduce_,
    local_kv_heads,
    split_even,
    split_kv_heads,
)
from megatron_sync.meta import TensorMeta

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

R, C, W, KV = Split.REPLICATED, Split.COLUMN, Split.ROW, Split.KV_HEADS


@dataclass(frozen=True)
class WeightRule:
    """One checkpoint tensor pattern ({L} layer, {E} expert) and how the engine shards and stores it.

    `fused` names the in-memory fused experts tensor (pattern with {L}) that holds
    expert E's `part`: "gate" and "up" are the halves of `gate_up_proj[E]`,
    "down" is `down_proj[E]`. Without `fused` the tensor lives under its own name.
    """

    pattern: str
    split: Split
    fused: str | None = None
    part: str | None = None


def _pattern_regex(pattern: str) -> re.Pattern:
    """Compile a rule pattern to a regex that must match a whole name."""
    rx = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(rx)


def _layer(suffix: str, split: Split, **kw) -> WeightRule:
    return WeightRule(f"model.layers.{{L}}.{suffix}", split, **kw)


EMBEDDINGS = [
    WeightRule("model.embed_tokens.weight", R),
    WeightRule("model.norm.weight", R),
    WeightRule("lm_head.weight", R),
]
LAYER_NORMS = [_layer("input_layernorm.weight", R), _layer("post_attention_layernorm.weight", R)]
GQA_ATTENTION = [
    _layer("self_attn.q_proj.weight", C), _layer("self_attn.q_proj.bias", C),
    _layer("self_attn.k_proj.weight", KV), _layer("self_attn.k_proj.bias", KV),
    _layer("self_attn.v_proj.weight", KV), _layer("self_attn.v_proj.bias", KV),
    _layer("self_attn.o_proj.weight", W), _layer("self_attn.o_proj.bias", R),
]
QK_NORM = [_layer("self_attn.q_norm.weight", R), _layer("self_attn.k_norm.weight", R)]
MLA_ATTENTION = [
    _layer("self_attn.q_proj.weight", C),  # when q_lora_rank is None
    _layer("self_attn.q_a_proj.weight", R), _layer("self_attn.q_a_proj.bias", R),
    _layer("self_attn.q_a_layernorm.weight", R),
    _layer("self_attn.q_b_proj.weight", C),
    _layer("self_attn.kv_a_proj_with_mqa.weight", R), _layer("self_attn.kv_a_proj_with_mqa.bias", R),
    _layer("self_attn.kv_a_layernorm.weight", R),
    _layer("self_attn.kv_b_proj.weight", C),
    _layer("self_attn.o_proj.weight", W), _layer("self_attn.o_proj.bias", R),
]
DENSE_MLP = [_layer("mlp.gate_proj.weight", C), _layer("mlp.up_proj.weight", C), _layer("mlp.down_proj.weight", W)]
_GATE_UP, _DOWN = "model.layers.{L}.mlp.experts.gate_up_proj", "model.layers.{L}.mlp.experts.down_proj"
ROUTED_EXPERTS = [
    _layer("mlp.gate.weight", R),
    _layer("mlp.experts.{E}.gate_proj.weight", C, fused=_GATE_UP, part="gate"),
    _layer("mlp.experts.{E}.up_proj.weight", C, fused=_GATE_UP, part="up"),
    _layer("mlp.experts.{E}.down_proj.weight", W, fused=_DOWN, part="down"),
]
SHARED_EXPERTS = [
    _layer("mlp.shared_experts.gate_proj.weight", C),
    _layer("mlp.shared_experts.up_proj.weight", C),
    _layer("mlp.shared_experts.down_proj.weight", W),
    _layer("mlp.gate.e_score_correction_bias", R),
]


@dataclass(frozen=True)
class FamilySpec:
    """A model family: its weight rules and its attention kind ("gqa" or "mla")."""

    rules: tuple[WeightRule, ...]
    attention: str


_GQA_DENSE = (*EMBEDDINGS, *LAYER_NORMS, *GQA_ATTENTION, *DENSE_MLP)
FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(_GQA_DENSE, "gqa"),
    "qwen2": FamilySpec(_GQA_DENSE, "gqa"),
    "qwen3": FamilySpec((*_GQA_DENSE, *QK_NORM), "gqa"),
    "qwen3_moe": FamilySpec((*_GQA_DENSE, *QK_NORM, *ROUTED_EXPERTS), "gqa"),
    "deepseek_v3": FamilySpec(
        (*EMBEDDINGS, *LAYER_NORMS, *MLA_ATTENTION, *DENSE_MLP, *ROUTED_EXPERTS, *SHARED_EXPERTS), "mla"
    ),
}


@dataclass(frozen=True)
class _Slot:
    """Where a checkpoint tensor lives in memory: a named tensor, optionally one expert's part of it."""

    memory_name: str
    expert: int | None
    part: str | None

    def view(self, live: torch.Tensor) -> torch.Tensor:
        """Return the region of the live in-memory tensor that holds this checkpoint tensor."""
        if self.part is None:
            return live
        if self.part == "down":
            return live[self.expert]
        half = live.shape[1] // 2
        return live[self.expert, :half] if self.part == "gate" else live[self.expert, half:]


def _checkpoint_entries(
    memory_name: str, shape: tuple[int, ...], compiled: list[tuple[WeightRule, re.Pattern, re.Pattern | None]]
) -> list[tuple[str, tuple[int, ...], WeightRule, _Slot]]:
    """Return the checkpoint tensors stored in in-memory tensor `memory_name` (several when fused)."""
    for rule, name_rx, fused_rx in compiled:
        if fused_rx is None:
            if name_rx.fullmatch(memory_name):
                return [(memory_name, shape, rule, _Slot(memory_name, None, None))]
            continue
        m = fused_rx.fullmatch(memory_name)
        if m is None:
            continue
        entries = []
        for same_fused in (r for r, _, _ in compiled if r.fused == rule.fused):
            part_shape = shape[1:] if same_fused.part == "down" else (shape[1] // 2, shape[2])
            for e in range(shape[0]):
                name = same_fused.pattern.replace("{L}", m["L"]).replace("{E}", str(e))
                entries.append((name, part_shape, same_fused, _Slot(memory_name, e, same_fused.part)))
        return sorted(entries, key=lambda entry: (entry[3].expert, entry[0]))
    return []


class ReferenceEngine:
    """One TP rank of a transformers model that loads HF-checkpoint-format shards.

    `group` is the torch.distributed group of this engine's ranks (None: the
    default group); all of `logits`, `generate` are collective over it.
    """

    def __init__(
        self,
        hf_config,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        family = getattr(hf_config, "model_type", None)
        if family not in FAMILIES:
            raise NotImplementedError(
                f"ReferenceEngine does not support model family {family!r}; supported: {sorted(FAMILIES)}"
            )
        if not (tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise ValueError(f"tp_rank={tp_rank} must lie in [0, tp_size={tp_size}) with tp_size >= 1")
        # Checked when a process group exists; without one the engine still shards (pure use).
        if tp_size > 1 and dist.is_initialized() and dist.get_world_size(group) != tp_size:
            raise ValueError(
                f"tp_size={tp_size} but the engine group has {dist.get_world_size(group)} ranks; "
                "pass the group of exactly this engine's ranks"
            )
        self.family, self.tp_rank, self.tp_size, self.group = family, tp_rank, tp_size, group
        self.spec = FAMILIES[family]
        self.config = copy.deepcopy(hf_config)
        self._check_heads()
        self._version = 0
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(self.config, dtype=dtype, experts_implementation="eager")
        self._index_checkpoint(model)
        with torch.device("meta"):
            self._parallelize(model)
        self.model = _materialize(model)
        self._live = {name: slot.view(_live_tensor(self.model, slot.memory_name)) for name, slot in self._slots.items()}

    # ---- what the engine loads (pure) ----

    @property
    def version(self) -> int:
        """The version of the weights in use now (0 before the first load)."""
        return self._version

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full HF-checkpoint tensors this engine loads, in a stable order."""
        return list(self._expected.values())

    def shard_dim(self, name: str) -> int | None:
        """Return the dimension of `name` split over TP ranks (None when every rank holds all of it)."""
        return self._rule(name).split.dim

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Return this rank's slice of the full checkpoint tensor `name` (a view; pure)."""
        rule, meta = self._rule(name), self._expected[name]
        if tuple(full.shape) != meta.shape:
            raise ValueError(
                f"{name}: got shape {tuple(full.shape)}, this {self.family} config expects {meta.shape}; "
                "send the full (unsharded, vocab-trimmed) HF tensor for the same config"
            )
        if full.dtype != meta.dtype:
            raise ValueError(f"{name}: got dtype {full.dtype}, this engine computes in {meta.dtype}; cast before sending")
        return self._split(rule.split, full)

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Return the shape of this rank's shard of `name`."""
        rule = self._rule(name)
        return tuple(self._split(rule.split, torch.empty(self._expected[name].shape, device="meta")).shape)

    # ---- live weights ----

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        """Copy one shard per expected tensor into the live weights and set `version`.

        Validates names and shapes of all shards before writing any.
        """
        missing = [n for n in self._expected if n not in shards]
        unexpected = sorted(n for n in shards if n not in self._expected)
        if missing or unexpected:
            raise ValueError(
                f"load_shards(version={version}) needs exactly the engine's expected tensors; "
                f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
                f"unexpected {unexpected[:8]} ({len(unexpected)})"
            )
        for name, shard in shards.items():
            live = self._live[name]
            if tuple(shard.shape) != tuple(live.shape) or shard.dtype != live.dtype:
                raise ValueError(
                    f"{name}: shard {tuple(shard.shape)} {shard.dtype} != this rank's "
                    f"{tuple(live.shape)} {live.dtype}; produce it with shard_of() of the same engine"
                )
        with torch.no_grad():
            for name, shard in shards.items():
                self._live[name].copy_(shard)
        self._version = version

    def state_shards(self) -> dict[str, torch.Tensor]:
        """Return copies of this rank's live shards by checkpoint-format name."""
        return {name: live.detach().clone() for name, live in self._live.items()}

    # ---- inference (collective over the engine group) ----

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return full-vocabulary logits [B, S, V] for `tokens` [B, S], identical on every rank."""
        return self.model(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache: Cache | None = None) -> tuple[torch.Tensor, Cache]:
        """Return logits [B, S, V] of `tokens` [B, S] placed after the `cache`d prefix, and the extended cache.

        `cache` is transformers' own KV cache (a `DynamicCache`, holding this
        rank's key/value heads); None starts a new one, so the call is a
        prefill. The cache is extended in place and returned.
        """
        out = self.model(input_ids=tokens, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, use_cache: bool = True) -> torch.Tensor:
        """Return `tokens` followed by `max_new_tokens` greedily chosen tokens ([B, S + n]).

        With `use_cache` the prompt is prefilled once and each decode step feeds
        only the newest token; without it every step recomputes the whole sequence.
        """
        cache, step_input = None, tokens
        for _ in range(max_new_tokens):
            if use_cache:
                logits, cache = self.forward_cached(step_input, cache)
            else:
                logits = self.logits(tokens)
            step_input = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, step_input], dim=1)
        return tokens

    @staticmethod
    def full_state_from_hf_model(model: nn.Module) -> dict[str, torch.Tensor]:
        """Return the HF-checkpoint-format full tensors (per-expert names) of a TP=1 transformers model."""
        return full_state_from_hf_model(model)

    # ---- construction ----

    def _check_heads(self) -> None:
        cfg, tp = self.config, self.tp_size
        if cfg.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} does not divide by the engine's tp_size={tp}; "
                "pick a tp_size that divides it"
            )
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if self.spec.attention == "gqa" and kv % tp and tp % kv:
            raise ValueError(
                f"num_key_value_heads={kv} and tp_size={tp}: one must divide the other "
                "(heads are split, or replicated when tp_size exceeds them)"
            )

    def _index_checkpoint(self, model: nn.Module) -> None:
        """Record every checkpoint tensor the model holds, its rule and where it lives in memory."""
        compiled = [
            (r, _pattern_regex(r.pattern), _pattern_regex(r.fused) if r.fused else None) for r in self.spec.rules
        ]
        self._expected, self._rules, self._slots = {}, {}, {}
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        for memory_name, tensor in model.state_dict().items():
            if tied and memory_name == "lm_head.weight":
                continue
            entries = _checkpoint_entries(memory_name, tuple(tensor.shape), compiled)
            if not entries:
                raise ValueError(
                    f"{self.family}: in-memory tensor {memory_name!r} matches no sharding rule; "
                    f"add a row for it to FAMILIES[{self.family!r}] in {__name__}"
                )
            for name, shape, rule, slot in entries:
                self._check_divisible(name, shape, rule.split)
                self._expected[name] = TensorMeta(name, shape, tensor.dtype)
                self._rules[name], self._slots[name] = rule, slot

    def _check_divisible(self, name: str, shape: tuple[int, ...], split: Split) -> None:
        if split in (Split.COLUMN, Split.ROW) and shape[split.dim] % self.tp_size:
            raise ValueError(
                f"{name}: dim {split.dim} of size {shape[split.dim]} does not divide by the engine's "
                f"tp_size={self.tp_size}; pick a tp_size that divides it"
            )

    def _rule(self, name: str) -> WeightRule:
        if name not in self._rules:
            raise ValueError(
                f"{name!r} is not a tensor of this {self.family} engine; expected HF checkpoint names "
                f"such as {next(iter(self._expected))!r} (see expected_tensors())"
            )
        return self._rules[name]

    def _split(self, split: Split, full: torch.Tensor) -> torch.Tensor:
        if split is Split.REPLICATED:
            return full
        if split is Split.KV_HEADS:
            return split_kv_heads(full, self.config.num_key_value_heads, self.tp_rank, self.tp_size)
        return split_even(full, split.dim, self.tp_rank, self.tp_size)

    def _parallelize(self, model: nn.Module) -> None:
        """Swap sharded projections and fused experts for local-shard versions (on the meta device)."""
        splits = {n.removesuffix(".weight"): r.split for n, r in self._rules.items() if r.fused is None}
        for module_name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                full_name = f"{module_name}.{child_name}" if module_name else child_name
                split = splits.get(full_name, Split.REPLICATED)
                if isinstance(child, nn.Linear) and split is not Split.REPLICATED:
                    setattr(module, child_name, self._tp_linear(full_name, child, split))
            if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):  # fused experts
                self._shard_fused_experts(module)
            if hasattr(module, "num_key_value_groups"):
                self._localize_attention(module)

    def _tp_linear(self, name: str, linear: nn.Linear, split: Split) -> nn.Module:
        local = self._split(split, linear.weight)
        has_bias = linear.bias is not None
        if split is Split.ROW:
            return RowParallelLinear(
                local.shape[1], linear.out_features, has_bias, linear.weight.dtype, self.group, self.tp_size
            )
        return ColumnParallelLinear(linear.in_features, local.shape[0], has_bias, linear.weight.dtype)

    def _shard_fused_experts(self, experts: nn.Module) -> None:
        """Keep this rank's gate/up rows ([gate_local; up_local]) and down columns; sum outputs."""
        num_experts, two_i, hidden = experts.gate_up_proj.shape
        i_local = two_i // 2 // self.tp_size
        dtype = experts.gate_up_proj.dtype
        experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * i_local, hidden, dtype=dtype))
        experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, i_local, dtype=dtype))
        experts.intermediate_dim = i_local
        group, tp = self.group, self.tp_size
        experts.register_forward_hook(lambda _m, _in, out: all_reduce_(out, group, tp))

    def _localize_attention(self, attn: nn.Module) -> None:
        """Make the head counts the attention module reshapes with local to this rank."""
        local_heads = self.config.num_attention_heads // self.tp_size
        if hasattr(attn, "num_heads"):
            attn.num_heads = local_heads
        if self.spec.attention == "gqa":
            attn.num_key_value_groups = local_heads // local_kv_heads(self.config.num_key_value_heads, self.tp_size)


def _live_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """Return the parameter or buffer called `name`."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _materialize(model: nn.Module) -> nn.Module:
    """Allocate a meta-device model on CPU: zeroed weights, rotary tables recomputed."""
    model.to_empty(device="cpu")
    model.requires_grad_(False)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if "inv_freq" in child._buffers:
                # Non-persistent buffers computed at init; to_empty left them uninitialized.
                setattr(module, child_name, type(child)(config=child.config))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty allocated lm_head and embed_tokens separately
    return model.eval()


def full_state_from_hf_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the HF-checkpoint-format full tensors (per-expert names) of a TP=1 transformers model.

    Goes through `save_pretrained`, the one place transformers 5 converts its
    fused in-memory experts back to checkpoint names.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for path in sorted(glob.glob(os.path.join(tmp, "*.safetensors"))):
            state.update(load_file(path))
    return state
