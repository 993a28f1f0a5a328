"""The reference inference engine: Hugging Face transformers on CPU with its own tensor parallelism.

Each engine rank builds the transformers model of the config's `model_type` on
the meta device, swaps its projections for tensor-parallel layers that hold only
this rank's shard, and only then allocates memory, so no rank ever holds the
full model. What the engine loads (names, shapes, dtypes) and how each tensor is
split come from the model family's one home in `megatron_sync.convert/` (each HF tensor
row's `Shard` role), sliced by `megatron_sync.layout` (`Sharding`, the one
place slices are computed) the way vLLM slices, except the vocabulary:

- COLUMN (dim 0) and ROW (dim 1, outputs summed over the group) in equal chunks;
- KV_HEADS by key/value heads, a head replicated when TP exceeds them;
- REPLICATED as is, and VOCAB whole too (embeddings and lm_head whole, so
  every rank computes full-vocabulary logits without a gather).

Its layout (`rank_layout()`) stores each HF tensor's shard as its own param,
named like the HF tensor; `load_shards` takes those params.

The engine speaks the HF checkpoint format (what the trainer sends), with
per-expert names; transformers 5 keeps experts fused in memory
(`mlp.experts.gate_up_proj[e] = [gate_e; up_e]`, `mlp.experts.down_proj[e]`),
and `FUSED_EXPERTS` (`engines/reference/memory.py`) says where each per-expert tensor lives inside the fused one.

Quantized checkpoints (an HF config with a `quantization_config`): the engine
expects the quantized names (FP8 values + `weight_scale_inv` / `weight_scale`,
INT4 `weight_packed` / `weight_scale` / `weight_shape`), holds a weight's
scales cut with the weight (block rows with their weight rows; a per-tensor
scale and INT4's `weight_shape` whole, as vLLM holds them), and at
`load_shards` dequantizes them into its float live weights. It keeps the received quantized shards as they came, so `snapshot()`
returns the wire format and a rollback reloads exactly what was there.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist
from torch import nn

from megatron_sync.convert import Shard, family_of_model_type, get_converter
from megatron_sync.engines.reference.draft import build_causal_lm, draft_logits
from megatron_sync.engines.reference.memory import (  # noqa: F401 (full_state_from_hf_model: its import path)
    _live_tensor, _materialize, _set_dtype, _slot_of, full_state_from_hf_model,
)
from megatron_sync.engines.reference.tp_layers import ColumnParallelLinear, RowParallelLinear, all_reduce_, local_kv_heads
from megatron_sync.layout.rank import RankLayout
from megatron_sync.layout.staging import HeldShards
from megatron_sync.layout.regions import VOCAB_WHOLE, Sharding
from megatron_sync.layout.roles import RoleLayout
from megatron_sync.core.meta import TensorMeta

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

class ReferenceEngine:
    """One TP rank of a transformers model that loads HF-checkpoint-format shards.

    `family` names the megatron_sync.convert family (default: the one whose `hf_model_types`
    include the config's `model_type`). `group` is the torch.distributed group of
    this engine's ranks (None: the default group); `logits` and `generate` are
    collective over it. The engine also holds the draft (multi-token-prediction)
    layers the config declares (`engines/draft.py`), unless `draft=False`.
    """

    def __init__(
        self,
        hf_config,
        *,
        tp_rank: int,
        tp_size: int,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        family: str | None = None,
        draft: bool = True,
    ):
        if not (tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise ValueError(f"tp_rank={tp_rank} must lie in [0, tp_size={tp_size}) with tp_size >= 1")
        # Checked when a process group exists; without one the engine still shards (pure use).
        if tp_size > 1 and dist.is_initialized() and dist.get_world_size(group) != tp_size:
            raise ValueError(
                f"tp_size={tp_size} but the engine group has {dist.get_world_size(group)} ranks; "
                "pass the group of exactly this engine's ranks"
            )
        self.family = family or family_of_model_type(getattr(hf_config, "model_type", None)).name
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.config = copy.deepcopy(hf_config)
        self.converter = get_converter(self.family, self.config, dtype=dtype, draft=draft)
        self._expected = {m.name: m for m in self.converter.expected_metas()}  # as received (quantized names)
        self._weights = {m.name: m for m in self.converter.expected_metas(quantized=False)}  # as computed with
        self._roles = {name: self.converter.shard_role(name) for name in self._weights}
        self._quantized_parts = {n for n in self._expected if self.converter.quant.weight_of(n) is not None}
        self._check_heads()
        self.sharding = Sharding(tp_size, num_kv_heads=self._num_kv_heads(), vocab=VOCAB_WHOLE)
        self._layout = RoleLayout(self.sharding).rank_layout(self.converter.tensor_specs(), tp_rank)  # edges checked
        self._params = {p.name: p for p in self._layout.params}
        self._version = 0
        with torch.device("meta"):
            model = build_causal_lm(self.config, dtype=dtype, draft_layers=self.converter.draft_layers)
        self._index_checkpoint(model)
        with torch.device("meta"):
            self._parallelize(model)
        self.model = _materialize(model)
        self._live = {name: slot.view(_live_tensor(self.model, slot.memory_name)) for name, slot in self._slots.items()}
        self._held = self._quantized_zeros()
        self._adopted: set[str] = set()  # live weights that run on a receiver's HeldShards (`load_shards`)

    # ---- what the engine loads (pure) ----

    @property
    def version(self) -> int:
        """The version of the weights in use now (0 before the first load)."""
        return self._version

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full HF-checkpoint tensors this engine loads, in the family's order."""
        return list(self._expected.values())

    def rank_layout(self) -> RankLayout:
        """Return this rank's layout: each HF tensor's shard (`Sharding.rank_region`) as its own param."""
        return self._layout

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Return the shape of this rank's shard of `name`."""
        if name not in self._params:
            raise ValueError(
                f"{name!r} is not a tensor of this {self.family} engine; expected HF checkpoint names "
                f"such as {next(iter(self._expected))!r} (see expected_tensors())"
            )
        return tuple(self._params[name].shape)

    # ---- live weights ----

    def load_shards(self, shards: Mapping[str, torch.Tensor], version: int) -> None:
        """Make one shard per expected tensor the live weights and set `version`.

        Validates names and shapes of all shards before writing any. `HeldShards` (a receiver's staging set,
        untouched while live) are run on in place where this rank's memory is laid out as they are: a whole
        unquantized tensor of the same dtype; the rest (fused experts, quantized weights) is copied. A
        weight run in place is never written: a later load by copy gives it memory of its own first.
        """
        self._check_shards(shards, version)
        quant, held = self.converter.quant, isinstance(shards, HeldShards)
        with torch.no_grad():
            for name, live in self._live.items():
                if name in quant.schemes:
                    self._owned(name).copy_(quant.dequantize(name, shards, live.dtype, shape=tuple(live.shape)))
                elif held and self._runs_on(name, shards[name]):
                    live.data = shards[name]  # the Parameter itself (whole slot): the model computes with it
                    self._adopted.add(name)
                else:
                    self._owned(name).copy_(shards[name])
        self._held = {name: shards[name] for name in self._quantized_parts}
        self._version = version

    def _check_shards(self, shards: Mapping[str, torch.Tensor], version: int) -> None:
        missing = [n for n in self._expected if n not in shards]
        unexpected = sorted(n for n in shards if n not in self._expected)
        if missing or unexpected:
            raise ValueError(
                f"load_shards(version={version}) needs exactly the engine's expected tensors; "
                f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
                f"unexpected {unexpected[:8]} ({len(unexpected)})"
            )
        for name, shard in shards.items():
            param = self._params[name]
            if tuple(shard.shape) != tuple(param.shape) or shard.dtype != param.dtype:
                raise ValueError(
                    f"{name}: shard {tuple(shard.shape)} {shard.dtype} != this rank's "
                    f"{tuple(param.shape)} {param.dtype}; cut it with this engine's rank_layout()"
                )

    def _runs_on(self, name: str, shard: torch.Tensor) -> bool:
        """True when `name`'s live tensor can be `shard` itself: a whole in-memory tensor, laid out alike."""
        live = self._live[name]
        return (self._slots[name].part is None and shard.dtype == live.dtype and shard.shape == live.shape
                and shard.device == live.device and shard.is_contiguous())

    def _owned(self, name: str) -> torch.Tensor:
        """Return `name`'s live tensor, first given memory of its own if it ran on a receiver's set."""
        live = self._live[name]
        if name in self._adopted:
            live.data = torch.empty_like(live)
            self._adopted.discard(name)
        return live

    def runs_in_place(self) -> int:
        """Return the bytes of live weights that are a receiver's held shards, not this engine's own memory."""
        return sum(self._live[name].nbytes for name in self._adopted)

    def loaded_params(self) -> dict[str, torch.Tensor]:
        """Return what this rank computes with, by layout param name (no copy): the live tensors, and for a
        quantized weight's parts the values handed to its dequantization (what the check can compare)."""
        return {name: (self._held[name] if name in self._quantized_parts else self._live[name])
                for name in self._expected}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Return copies of this rank's shards by checkpoint-format name, as `load_shards` takes them
        (for rollback): live tensors, and the quantized shards last loaded for a quantized weight."""
        return {name: (self._held[name] if name in self._quantized_parts else self._live[name]).detach().clone()
                for name in self._expected}

    # ---- memory handoff (colocated jobs: megatron_sync.engines.handoff) ----

    def release_memory(self) -> int:
        """Free the live weights' memory while the trainer trains; return the bytes freed.

        The tensors stay, with empty storage until `restore_memory`: a forward fails loudly instead of
        computing with stale values. The receiver's live staging set still holds this version. A weight that
        runs on that set (`load_shards` of `HeldShards`) has no memory of its own to free and is left alone.
        """
        self._released = [(storage, storage.nbytes()) for storage in self._live_storages() if storage.nbytes()]
        for storage, _ in self._released:
            storage.resize_(0)
        return sum(nbytes for _, nbytes in self._released)

    def restore_memory(self) -> int:
        """Allocate the released live weights again (their values come with the next load); return the bytes."""
        released, self._released = getattr(self, "_released", []), []
        for storage, nbytes in released:
            storage.resize_(nbytes)
        return sum(nbytes for _, nbytes in released)

    def _live_storages(self) -> list[torch.UntypedStorage]:
        """Each distinct storage of the live weights once (tied and fused weights share one)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for live in (t for name, t in self._live.items() if name not in self._adopted):
            storage = live.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    # ---- inference (collective over the engine group) ----

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return full-vocabulary logits [B, S, V] for `tokens` [B, S], identical on every rank."""
        return self.model(input_ids=tokens, use_cache=False).logits

    def token_logprobs(self, tokens: list[int]) -> list[float]:
        """Return log p(token i + 1 | tokens 0..i) for the sequence `tokens` (collective over the engine group)."""
        ids = torch.tensor([tokens])
        logp = torch.log_softmax(self.logits(ids)[0, :-1].float(), dim=-1)
        return logp.gather(-1, ids[0, 1:].view(-1, 1)).view(-1).tolist()

    def draft_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return the draft layers' next-token logits [depth, B, S, V] for `tokens` [B, S] (collective)."""
        return draft_logits(self.model, tokens)

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
        kv = self._num_kv_heads()
        if self._has_kv_heads and kv % tp and tp % kv:
            raise ValueError(
                f"num_key_value_heads={kv} and tp_size={tp}: one must divide the other "
                "(heads are split, or replicated when tp_size exceeds them)"
            )

    def _num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads

    @property
    def _has_kv_heads(self) -> bool:
        """True for grouped-query attention (separate key/value heads), False for MLA."""
        return Shard.KV_HEADS in self._roles.values()

    def _index_checkpoint(self, model: nn.Module) -> None:
        """Find every weight's place in memory; every in-memory tensor must get one."""
        memory = model.state_dict()
        self._slots = {}
        for name, meta in self._weights.items():
            slot = _slot_of(name, memory)
            if slot is None:
                raise ValueError(
                    f"{self.family}: checkpoint tensor {name!r} has no place in transformers' "
                    f"{type(model).__name__}; the family's HF layout and the HF config disagree"
                )
            self._slots[name] = slot
        covered = {slot.memory_name for slot in self._slots.values()}
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        uncovered = [n for n in memory if n not in covered and not (tied and n == "lm_head.weight")]
        if uncovered:
            raise ValueError(
                f"{self.family}: in-memory tensors {uncovered[:8]} of transformers' {type(model).__name__} "
                f"are not in the family's HF layout; add HFTensor rows for them in megatron_sync.convert/{self.family}.py"
            )

    def _quantized_zeros(self) -> dict[str, torch.Tensor]:
        """Return the quantized shards of this rank's (zero) quantized weights: what `snapshot()`
        holds for them before the first load."""
        return {out: t for weight in self.converter.quant.schemes
                for out, t in self.converter.quant.quantize(
                    weight, torch.zeros(self._live[weight].shape, dtype=self._weights[weight].dtype))}

    def _parallelize(self, model: nn.Module) -> None:
        """Swap sharded projections and fused experts for local-shard versions (on the meta device);
        give every tensor the dtype the family loads it in (DeepSeek's router stays float32)."""
        direct = {n: s for n, s in self._slots.items() if s.part is None}
        for module_name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                weight = f"{module_name}.{child_name}.weight" if module_name else f"{child_name}.weight"
                if isinstance(child, nn.Linear) and weight in direct:
                    local = tuple(self._params[weight].shape) if weight in self._params else None
                    if local is not None and local != tuple(child.weight.shape):
                        setattr(module, child_name, self._tp_linear(child, self._roles[weight], local))
            if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):  # fused experts
                self._shard_fused_experts(module)
            if hasattr(module, "num_key_value_groups"):
                self._localize_attention(module)
        for name in direct:
            _set_dtype(model, name, self._weights[name].dtype)

    def _tp_linear(self, linear: nn.Linear, role: Shard, local: tuple[int, ...]) -> nn.Module:
        """Return the TP linear holding this rank's `local` shard of `linear` (summed over the group for ROW)."""
        has_bias = linear.bias is not None
        if role is Shard.ROW:
            return RowParallelLinear(local[1], linear.out_features, has_bias, linear.weight.dtype, self.group,
                                     self.tp_size)
        return ColumnParallelLinear(linear.in_features, local[0], has_bias, linear.weight.dtype)

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
        if self._has_kv_heads:
            attn.num_key_value_groups = local_heads // local_kv_heads(self.config.num_key_value_heads, self.tp_size)
