"""Tiny Megatron model families built on CPU with megatron-core's local spec, for the demo and the test suite.

Each family has a ``ModelSpec`` with tiny sizes, the matching Megatron
``TransformerConfig`` and Hugging Face config, seeded reference weights in the
single-rank Megatron naming, and a loader that copies each rank's slice of those
weights into model chunks built under any TP/PP/VPP/EP/ETP layout.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
import torch.nn.functional as F

from megatron_sync.convert import get_family
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.families.mtp import MTP_STAGE_EMBEDDING

__all__ = [
    "ModelSpec",
    "NOT_ON_REFERENCE_ENGINE",
    "family_traits",
    "megatron_config",
    "padded_vocab_size",
    "build_model_chunks",
    "hf_config",
    "reference_shapes",
    "reference_weights",
    "load_reference_weights",
    "megatron_logits",
    "megatron_draft_logits",
    "KIMI_K2",
]

VOCAB_DIVISOR = 128  # Megatron-LM's default --make-vocab-size-divisible-by

# Shipped families the reference engine (megatron_sync/engines/reference/engine.py) cannot run at TP > 1 yet:
# transformers stacks gpt-oss's experts and the engine has no place for one expert's tensors in that stack
# (its FUSED_EXPERTS), so it refuses gpt-oss by name; its TP does not split a gated-delta-net layer, so
# Qwen3-Next computes correctly on it at TP=1 only.
NOT_ON_REFERENCE_ENGINE = ("gpt_oss", "qwen3_next")


@dataclasses.dataclass(frozen=True)
class FamilyTraits:
    """What a tiny Megatron model of a family must contain, read off the family's HF layout rows."""

    qkv_bias: bool
    qk_norm: bool
    mla: bool
    moe: bool
    shared_experts: bool
    router_bias: bool
    attention_sinks: bool = False  # gpt-oss: learnable softmax offsets, biased linears, clamped SwiGLU experts
    linear_attention: bool = False  # Qwen3-Next: gated delta net + gated attention, zero-centered norms
    shared_expert_gate: bool = False


def family_traits(family: str) -> FamilyTraits:
    """Return the traits of registered megatron_sync.convert family `family` (its tables are the one source)."""
    fam = get_family(family)
    rows = [row.name for row in fam.hf_tensors]

    def has(suffix: str) -> bool:
        return any(name.endswith(suffix) for name in rows)

    return FamilyTraits(
        qkv_bias=has("self_attn.q_proj.bias"),
        qk_norm=has("self_attn.q_norm.weight"),
        mla=has("self_attn.kv_b_proj.weight"),
        moe=any("{expert}" in name for name in rows),
        shared_experts=has("mlp.shared_experts.down_proj.weight") or has("mlp.shared_expert.down_proj.weight"),
        router_bias=bool(fam.buffers),
        attention_sinks=has("self_attn.sinks"),
        linear_attention=has("linear_attn.in_proj_qkvz.weight"),
        shared_expert_gate=has("mlp.shared_expert_gate.weight"),
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny model of one registered family; every size is small enough for CPU runs.

    `hf_model_type` is the transformers architecture to build (default: the
    family's first `hf_model_types` entry).
    """

    family: str
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128
    vocab_size: int = 250  # not a multiple of 128: padding matters
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    partial_rotary_factor: float | None = None  # RoPE on this fraction of each head (Megatron rotary_percent);
    # None: the family's usual (Qwen3-Next 0.25, else 1.0)
    # MoE (qwen3_moe, deepseek_v3, glm4_moe)
    num_experts: int = 8
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 32
    num_shared_experts: int = 1  # deepseek_v3, glm4_moe
    first_k_dense_replace: int = 1  # deepseek_v3, glm4_moe
    routed_scaling_factor: float = 1.0  # deepseek_v3, glm4_moe: routing weights times this
    mtp_layers: int = 0  # multi-token-prediction draft layers (deepseek_v3, glm4_moe): mtp_num_layers
    # Multi-Latent Attention (deepseek_v3)
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # gpt-oss: the clamp of its SwiGLU; its sliding-window layers attend to this many tokens (HF sliding_window)
    swiglu_limit: float = 7.0
    sliding_window: int = 4
    # Qwen3-Next: gated-delta-net heads, every full_attention_interval-th layer full attention, partial RoPE
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 2
    hf_model_type: str | None = None
    params_dtype: str = "float32"  # the Megatron model's weights ("bfloat16": as a bf16 training job holds them)

    def __post_init__(self):
        family = get_family(self.family)  # UnknownFamilyError names the registered ones
        if self.hf_model_type is None:
            object.__setattr__(self, "hf_model_type", family.hf_model_types[0])
        if self.traits.shared_experts and not 0 < self.first_k_dense_replace < self.num_layers:
            raise ValueError("first_k_dense_replace must leave at least one MoE layer")
        if self.mtp_layers and get_family(self.family).draft_layers_key is None:
            raise ValueError(f"family {self.family!r} has no draft layers; use mtp_layers=0")

    @property
    def traits(self) -> FamilyTraits:
        return family_traits(self.family)

    @property
    def is_moe(self) -> bool:
        return self.traits.moe

    @property
    def is_mla(self) -> bool:
        return self.traits.mla

    @property
    def sliding_layers(self) -> list[bool]:
        """Per layer, whether gpt-oss attends through its sliding window there (HF layer_types' default)."""
        return [i % 2 == 0 for i in range(self.num_layers)]

    @property
    def linear_attention_layers(self) -> list[bool]:
        """Per layer, whether Qwen3-Next runs gated delta net there (HF full_attention_interval's pattern)."""
        return [(i + 1) % self.full_attention_interval != 0 for i in range(self.num_layers)]

    @property
    def rotary_percent(self) -> float:
        """The fraction of each head's dims rotated by RoPE."""
        if self.partial_rotary_factor is not None:
            return self.partial_rotary_factor
        return 0.25 if self.traits.linear_attention else 1.0

    @property
    def moe_layers(self) -> list[int]:
        """Global indices of the layers whose MLP is a mixture of experts (the family's own rule), the
        draft layers (num_layers + d) included."""
        if not self.is_moe:
            return []
        config = HFConfig(hf_config(self), self.family)
        return [i for i in range(self.num_layers + self.mtp_layers) if get_family(self.family).is_moe_layer(config, i)]


def padded_vocab_size(spec: ModelSpec, tp: int) -> int:
    """Return the vocabulary size Megatron-LM pads to: a multiple of 128 * TP."""
    multiple = VOCAB_DIVISOR * tp
    return math.ceil(spec.vocab_size / multiple) * multiple


# ---------------------------------------------------------------- Megatron side


def megatron_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                    ep: int = 1, etp: int | None = None):
    """Return the Megatron TransformerConfig (MLATransformerConfig for deepseek_v3) of ``spec``."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_heads if spec.is_mla else spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.traits.qkv_bias,
        qk_layernorm=spec.traits.qk_norm or spec.traits.mla,  # MLA: the q/kv latent norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=getattr(torch, spec.params_dtype),
        pipeline_dtype=getattr(torch, spec.params_dtype),  # required by Megatron when PP > 1
        bf16=spec.params_dtype == "bfloat16",
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp,
        sequence_parallel=False,
    )
    if spec.is_moe:
        kwargs.update(_moe_config(spec))
    if spec.traits.attention_sinks:
        kwargs.update(_gpt_oss_config(spec))
    if spec.traits.linear_attention:
        kwargs.update(_qwen3_next_config(spec))
    if spec.mtp_layers:
        kwargs.update(mtp_num_layers=spec.mtp_layers, mtp_loss_scaling_factor=0.1)
    if spec.is_mla:
        kwargs.update(
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_nope_head_dim,
            qk_pos_emb_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_type="rope",
            rotary_base=spec.rope_theta,
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=0.0,
        )
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _gpt_oss_config(spec: ModelSpec) -> dict:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(
        add_bias_linear=True,  # q/k/v/o, router and expert biases
        softmax_type="learnable",  # attention sinks
        # Megatron's window (w, 0) lets a token see w earlier tokens; HF's sliding_window counts the token too.
        window_size=(spec.sliding_window - 1, 0),
        window_attn_skip_freq=[int(sliding) for sliding in spec.sliding_layers],
        activation_func=quick_gelu,  # x * sigmoid(1.702 x): gpt-oss's swiglu_alpha
        glu_linear_offset=1.0,  # (up + 1) * glu
        activation_func_clamp_value=spec.swiglu_limit,
    )


def _qwen3_next_config(spec: ModelSpec) -> dict:
    return dict(
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in spec.linear_attention_layers],
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
    )


def _moe_config(spec: ModelSpec) -> dict:
    common = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_layer_freq=[1 if i in spec.moe_layers else 0 for i in range(spec.num_layers)],  # MTP: like the last
        moe_grouped_gemm=False,  # SequentialMLP: mlp.experts.local_experts.{j}
        moe_token_dispatcher_type="allgather",  # alltoall builds a torch.cuda.Stream
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_permute_fusion=False,
        moe_router_pre_softmax=False,  # top-k, then normalize: HF norm_topk_prob=True
    )
    if spec.traits.router_bias:  # DeepSeek-style: sigmoid scores, a bias choosing experts, shared experts
        common.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=spec.routed_scaling_factor,
        )
    else:
        common.update(moe_router_score_function="softmax")
    if spec.traits.shared_experts:
        common.update(moe_shared_expert_intermediate_size=spec.moe_ffn_hidden_size * spec.num_shared_experts,
                      moe_shared_expert_gate=spec.traits.shared_expert_gate)
    return common


def _layer_specs(spec: ModelSpec, config, vp_stage, pp_rank):
    """Return (decoder block spec, MTP block spec or None) of this stage; the MTP layer is built like the
    stage's last decoder layer (megatron-core's rule) and exists only on the last stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    from examples.tiny.cpu_hybrid import hybrid_block_spec
    from examples.tiny.cpu_shim import use_cpu_core_attention

    if spec.traits.linear_attention:  # Qwen3-Next's MTP layers are not mapped (README)
        return hybrid_block_spec(config, spec.linear_attention_layers, vp_stage=vp_stage, pp_rank=pp_rank), None
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm",
        vp_stage=vp_stage, pp_rank=pp_rank,
    )
    if spec.is_mla:
        block.layer_specs = [use_cpu_core_attention(s) for s in block.layer_specs]
    mtp = None
    if spec.mtp_layers:
        mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank)
    return block, mtp


def build_model_chunks(spec: ModelSpec, *, vpp: int | None = None, pg_collection=None) -> list:
    """Build this rank's GPTModel chunk(s) under the already initialized ``parallel_state``.

    ``vpp`` defaults to parallel_state's virtual pipeline size; if given it must agree.
    Chunks are in eval mode, float32, on CPU, with the vocabulary padded per
    ``padded_vocab_size`` and pre/post_process set per PP/VPP stage. A
    ``pg_collection`` (megatron-core's ProcessGroupCollection) builds the model
    over its groups instead (one stage; its TP size), e.g. a second layout in
    the same processes.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from examples.tiny.cpu_shim import apply_cpu_shims

    apply_cpu_shims()
    state_vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and state_vpp is not None and vpp != state_vpp:
        raise ValueError(f"vpp={vpp} disagrees with parallel_state's virtual pipeline size {state_vpp}")
    vpp = vpp if vpp is not None else state_vpp
    tp = ps.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
    config = megatron_config(
        spec, tp=tp, pp=ps.get_pipeline_model_parallel_world_size(), vpp=vpp,
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        block, mtp_block = _layer_specs(spec, config, stage, pp_rank)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=mtp_block,
            vocab_size=padded_vocab_size(spec, tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            rotary_percent=spec.rotary_percent,
            vp_stage=stage,
            pg_collection=pg_collection,
        )
        model.megatron_sync_spec = spec  # lets megatron_logits trim the padded vocabulary
        chunks.append(model.eval())
    return chunks


# ---------------------------------------------------------------- Hugging Face side


def _sigmoid_router_moe_kwargs(spec: ModelSpec) -> dict:
    """DeepSeek-V3's and GLM-4.5's MoE config: routed + shared experts, dense first layers, MTP draft layers."""
    return dict(
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        n_routed_experts=spec.num_experts,
        n_shared_experts=spec.num_shared_experts,
        num_experts_per_tok=spec.moe_topk,
        first_k_dense_replace=spec.first_k_dense_replace,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=spec.routed_scaling_factor,
        num_nextn_predict_layers=spec.mtp_layers,
    )


def _deepseek_v3_kwargs(spec: ModelSpec) -> dict:
    return dict(
        **_sigmoid_router_moe_kwargs(spec),
        num_key_value_heads=spec.num_heads,  # MLA: one latent KV per head
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_interleave=True,  # Megatron's MLA RoPE de-interleaves the same way
        attention_bias=False,
        topk_method="noaux_tc", scoring_func="sigmoid",  # as DeepSeek-V3's config.json says (vLLM reads them)
    )


def _glm4_moe_kwargs(spec: ModelSpec) -> dict:
    return dict(
        **_sigmoid_router_moe_kwargs(spec),
        head_dim=spec.head_dim,
        attention_bias=True,  # GLM-4.5: q/k/v biases
        use_qk_norm=True,  # GLM-4.5 (GLM-4.5-Air has none)
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.rotary_percent},
    )


# Kimi-K2 is DeepSeek-V3's architecture (its config.json: model_type "kimi_k2", DeepseekV3ForCausalLM) with
# many more experts, one dense layer, and routed_scaling_factor 2.827; scaled down here, with 32 tiny experts.
KIMI_K2 = dict(family="deepseek_v3", num_experts=32, moe_topk=8, moe_ffn_hidden_size=16, first_k_dense_replace=1,
               num_shared_experts=1, routed_scaling_factor=2.827)

# transformers' config arguments per architecture (HF model_type), beyond the common ones.
_ARCHITECTURE_KWARGS = {
    "llama": lambda s: dict(head_dim=s.head_dim, attention_bias=False, mlp_bias=False),
    "mistral": lambda s: dict(head_dim=s.head_dim, sliding_window=None),
    "qwen2": lambda s: dict(use_sliding_window=False),  # q/k/v biases are built in, no flag
    "qwen3": lambda s: dict(head_dim=s.head_dim, attention_bias=False, use_sliding_window=False),
    "qwen3_moe": lambda s: dict(
        head_dim=s.head_dim, attention_bias=False, use_sliding_window=False,
        num_experts=s.num_experts, num_experts_per_tok=s.moe_topk,
        moe_intermediate_size=s.moe_ffn_hidden_size, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
    ),
    "deepseek_v3": _deepseek_v3_kwargs,
    "gpt_oss": lambda s: dict(
        head_dim=s.head_dim, num_local_experts=s.num_experts, num_experts_per_tok=s.moe_topk,
        intermediate_size=s.moe_ffn_hidden_size,  # gpt-oss sizes its experts by intermediate_size
        sliding_window=s.sliding_window, swiglu_limit=s.swiglu_limit, swiglu_alpha=1.702, attention_bias=True,
        layer_types=["sliding_attention" if w else "full_attention" for w in s.sliding_layers],
        router_aux_loss_coef=0.0,
        # vLLM's gpt_oss always builds YaRN RoPE; factor 1 makes it the plain RoPE Megatron applies.
        rope_parameters={"rope_type": "yarn", "rope_theta": s.rope_theta, "factor": 1.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": s.max_position_embeddings},
    ),
    "qwen3_next": lambda s: dict(
        head_dim=s.head_dim, attention_bias=False, num_experts=s.num_experts, num_experts_per_tok=s.moe_topk,
        moe_intermediate_size=s.moe_ffn_hidden_size,
        shared_expert_intermediate_size=s.moe_ffn_hidden_size * s.num_shared_experts,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
        linear_num_key_heads=s.linear_num_key_heads, linear_num_value_heads=s.linear_num_value_heads,
        linear_key_head_dim=s.linear_key_head_dim, linear_value_head_dim=s.linear_value_head_dim,
        linear_conv_kernel_dim=s.linear_conv_kernel_dim,
        layer_types=["linear_attention" if la else "full_attention" for la in s.linear_attention_layers],
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta,
                         "partial_rotary_factor": s.rotary_percent},
    ),
    "glm4_moe": _glm4_moe_kwargs,
}


def hf_config(spec: ModelSpec):
    """Return the transformers config (architecture `spec.hf_model_type`) that matches the Megatron model."""
    import transformers

    if spec.hf_model_type not in _ARCHITECTURE_KWARGS:
        raise ValueError(f"no tiny-config recipe for HF model_type {spec.hf_model_type!r}; "
                         f"add one to _ARCHITECTURE_KWARGS in {__name__}")
    kwargs = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_dropout=0.0,
    )
    kwargs.update(_ARCHITECTURE_KWARGS[spec.hf_model_type](spec))
    return transformers.AutoConfig.for_model(spec.hf_model_type, **kwargs)


# ---------------------------------------------------------------- reference weights


def _gated_delta_net_shapes(spec: ModelSpec) -> dict[str, tuple]:
    qk, v, heads = spec.linear_num_key_heads * spec.linear_key_head_dim, \
        spec.linear_num_value_heads * spec.linear_value_head_dim, spec.linear_num_value_heads
    return {
        "self_attention.in_proj.weight": (2 * qk + 2 * v + 2 * heads, spec.hidden_size),
        "self_attention.conv1d.weight": (2 * qk + v, 1, spec.linear_conv_kernel_dim),
        "self_attention.A_log": (heads,),
        "self_attention.dt_bias": (heads,),
        "self_attention.out_norm.weight": (spec.linear_value_head_dim,),
        "self_attention.out_proj.weight": (spec.hidden_size, v),
    }


def _attention_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple]:
    h, d = spec.hidden_size, spec.head_dim
    if spec.traits.linear_attention and spec.linear_attention_layers[layer]:
        return _gated_delta_net_shapes(spec)
    if spec.is_mla:
        q_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        return {
            "self_attention.linear_q_down_proj.weight": (spec.q_lora_rank, h),
            "self_attention.q_layernorm.weight": (spec.q_lora_rank,),
            "self_attention.linear_q_up_proj.weight": (spec.num_heads * q_head, spec.q_lora_rank),
            "self_attention.linear_kv_down_proj.weight": (spec.kv_lora_rank + spec.qk_rope_head_dim, h),
            "self_attention.kv_layernorm.weight": (spec.kv_lora_rank,),
            "self_attention.linear_kv_up_proj.weight": (
                spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
            "self_attention.linear_proj.weight": (h, spec.num_heads * spec.v_head_dim),
        }
    gated = spec.traits.linear_attention  # Qwen3-Next's full attention: a gate head per query head
    qkv_rows = ((2 if gated else 1) * spec.num_heads + 2 * spec.num_kv_heads) * d
    shapes = {
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_proj.weight": (h, spec.num_heads * d),
    }
    if spec.traits.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv_rows,)
    if spec.traits.attention_sinks:
        shapes["self_attention.linear_proj.bias"] = (h,)
        shapes["self_attention.core_attention.softmax_offset"] = (spec.num_heads,)
    if spec.traits.qk_norm:
        shapes["self_attention.q_layernorm.weight"] = (d,)
        shapes["self_attention.k_layernorm.weight"] = (d,)
    return shapes


def _layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple]:
    """Return the shapes of decoder layer `layer` (a draft layer when >= num_layers), names relative to it."""
    h = spec.hidden_size
    return {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
            **_attention_shapes(spec, layer), **_mlp_shapes(spec, layer)}


def _mlp_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple]:
    h = spec.hidden_size
    if layer not in spec.moe_layers:
        f = spec.ffn_hidden_size
        return {"mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}
    f = spec.moe_ffn_hidden_size
    biased = spec.traits.attention_sinks  # gpt-oss: router and experts have biases
    shapes = {"mlp.router.weight": (spec.num_experts, h)}
    if biased:
        shapes["mlp.router.bias"] = (spec.num_experts,)
    for e in range(spec.num_experts):
        shapes[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
        shapes[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        if biased:
            shapes[f"mlp.experts.local_experts.{e}.linear_fc1.bias"] = (2 * f,)
            shapes[f"mlp.experts.local_experts.{e}.linear_fc2.bias"] = (h,)
    if spec.traits.router_bias:
        shapes["mlp.router.expert_bias"] = (spec.num_experts,)
    if spec.traits.shared_experts:
        fs = f * spec.num_shared_experts
        shapes["mlp.shared_experts.linear_fc1.weight"] = (2 * fs, h)
        shapes["mlp.shared_experts.linear_fc2.weight"] = (h, fs)
    if spec.traits.shared_expert_gate:
        shapes["mlp.shared_experts.gate_weight"] = (1, h)
    return shapes


def reference_shapes(spec: ModelSpec) -> dict[str, tuple]:
    """Return name -> shape of the full single-rank Megatron weights (vocab rows unpadded)."""
    h = spec.hidden_size
    shapes = {"embedding.word_embeddings.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in _layer_shapes(spec, i).items()})
    shapes["decoder.final_layernorm.weight"] = (h,)
    for d in range(spec.mtp_layers):  # megatron-core's MultiTokenPredictionLayer
        m = f"mtp.layers.{d}."
        shapes.update({m + "enorm.weight": (h,), m + "hnorm.weight": (h,), m + "eh_proj.weight": (h, 2 * h)})
        shapes.update({f"{m}transformer_layer.{k}": v for k, v in _layer_shapes(spec, spec.num_layers + d).items()})
        shapes[m + "final_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (spec.vocab_size, h)
    return shapes


def _norm_value(noise: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    return (0.0 if zero_centered else 1.0) + 0.1 * noise  # gamma near 1 (stored as gamma - 1 when zero-centered)


# Values by name ending, first match (norms near their gamma, biases small, sink logits and A_log O(1));
# any other tensor is a weight scaled by its fan-in, which keeps activations O(1).
_REFERENCE_VALUES = (
    ("norm.weight", _norm_value),  # every RMSNorm: *layernorm, GDN's out_norm, MTP's enorm / hnorm
    ("expert_bias", lambda noise, zc: 0.1 * noise),  # non-zero, large enough to change some top-k choices
    (".bias", lambda noise, zc: 0.1 * noise),
    ("dt_bias", lambda noise, zc: 0.1 * noise),
    ("softmax_offset", lambda noise, zc: noise),
    ("A_log", lambda noise, zc: 0.5 * noise),
)


def _reference_tensor(name: str, shape: tuple, seed: int, zero_centered: bool = False) -> torch.Tensor:
    # One generator per name: a tensor's values do not depend on which other tensors exist.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    for suffix, value in _REFERENCE_VALUES:
        if name.endswith(suffix):
            return value(noise, zero_centered)
    return noise / math.sqrt(math.prod(shape[1:]))


def reference_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Return the full, unsharded Megatron weights of ``spec``, deterministic from ``seed``.

    Names are those of a TP=1/PP=1/EP=1 local-spec model (global layer and expert
    indices); vocabulary rows are ``spec.vocab_size`` (unpadded); the router
    ``expert_bias`` buffer is included where the family has one.
    """
    zero_centered = spec.traits.linear_attention  # Qwen3-Next's norms store gamma - 1
    return {name: _reference_tensor(name, shape, seed, zero_centered)
            for name, shape in reference_shapes(spec).items()}


# ---------------------------------------------------------------- loading a rank's slice

_VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight", MTP_STAGE_EMBEDDING)


def _rank_slice(full: torch.Tensor, local, spec: ModelSpec, layout) -> torch.Tensor:
    """Return this rank's slice of ``full`` for the walked local tensor ``local`` (a SourceTensor).

    The inverse of the library's gather: the same sharding attributes, the same split.
    """
    from megatron_sync.trainer.gather import split_strided_shard

    if local.name in _VOCAB_NAMES:
        padded = torch.zeros(padded_vocab_size(spec, layout.tp), full.shape[1], dtype=full.dtype)
        padded[: full.shape[0]] = full
        full = padded
    sharding = local.sharding
    if sharding.axis is None:
        return full
    size, rank = (layout.etp, layout.etp_rank) if sharding.axis == "etp" else (layout.tp, layout.tp_rank)
    return split_strided_shard(full, sharding.dim, sharding.stride, size, rank)


def _names_this_rank_should_load(full: dict, walked: list, layout) -> set[str]:
    """The names of ``full`` that belong to this rank: its layers (its own experts only) and, for
    the names outside layers, the ones its chunks hold."""
    layers = {t.name.split(".")[2] for t in walked if t.name.startswith("decoder.layers.")}
    others = set()
    for t in walked:
        if t.expert is not None:
            owned = range(layout.ep_rank * t.expert.num_local, (layout.ep_rank + 1) * t.expert.num_local)
            others |= {t.expert.template.format(expert=e) for e in range(t.expert.num_local * layout.ep)
                       if e not in owned}
    held = {t.name for t in walked}
    return {n for n in full
            if (n.startswith("decoder.layers.") and n.split(".")[2] in layers and n not in others)
            or (not n.startswith("decoder.layers.") and n in held)}


def load_reference_weights(chunks: list, full: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """Copy this rank's slice of ``full`` (see ``reference_weights``) into ``chunks`` in place.

    Works for any TP/PP/VPP/EP/ETP layout under the current ``parallel_state``: the
    library's own source walk names every local tensor globally and says how it is
    sharded. Raises ``KeyError`` if a local parameter or buffer has no full tensor,
    ``ValueError`` on a shape mismatch or if a full tensor this rank should hold was not used.
    """
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.source import walk_model_chunks

    layout = ParallelLayout.from_megatron()
    walked = walk_model_chunks(chunks, layout, is_buffer=lambda name: name in full)
    used = set()
    for local in walked:
        name = local.name
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
        if name == MTP_STAGE_EMBEDDING:
            name = "embedding.word_embeddings.weight"  # the MTP stage's copy of the embedding
        if name not in full:
            raise KeyError(f"local tensor {local.name!r} has no reference tensor")
        piece = _rank_slice(full[name], local, spec, layout)
        if piece.shape != local.tensor.shape:
            raise ValueError(f"{local.name!r}: slice {tuple(piece.shape)} != local {tuple(local.tensor.shape)}")
        with torch.no_grad():
            local.tensor.copy_(piece)
        used.add(name)
    unused = _names_this_rank_should_load(full, walked, layout) - used
    if unused:
        raise ValueError(f"reference tensors not loaded on this rank: {sorted(unused)}")


# ---------------------------------------------------------------- forward


def megatron_logits(chunks: list, tokens: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Return eval-mode logits ``[batch, seq, vocab]``, gathered over TP, on every rank.

    With PP > 1 (and virtual stages) the hidden states walk the stages in
    Megatron's order — chunk v of stage 0, 1, ..., then chunk v+1 — over plain
    point-to-point sends on the pipeline group, because megatron-core 0.16.1's
    p2p schedule allocates on CUDA. The padded vocabulary is trimmed to
    ``vocab_size`` (default: the spec the chunks were built from).
    """
    return _gathered(chunks, tokens, vocab_size, draft=False)


def megatron_draft_logits(chunks: list, tokens: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Return the MTP block's logits ``[depth, batch, seq, vocab]`` from Megatron's own forward, on every rank.

    Depth d at position i predicts token i + 2 + d from the main model's hidden state at i and the
    embedding of token i + 1 + d (megatron-core rolls the input ids left, so the last d + 1
    positions see padding); every rank gets them, gathered over TP like ``megatron_logits``.
    """
    return _gathered(chunks, tokens, vocab_size, draft=True)


def _gathered(chunks: list, tokens: torch.Tensor, vocab_size: int | None, *, draft: bool) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    vocab_size = vocab_size or chunks[0].megatron_sync_spec.vocab_size
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        logits = _pipeline_forward(chunks, tokens, draft)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        pieces = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(pieces, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(pieces, dim=-1)
    return logits[..., :vocab_size]


def _run_chunk(chunk, tokens: torch.Tensor, positions: torch.Tensor, draft: bool) -> torch.Tensor:
    """Return one chunk's output: hidden states, or on the last stage its local logits ([B, S, V/tp]; with
    `draft`, the MTP block's [D, B, S, V/tp]).

    megatron-core 0.16.1's GPTModel runs its MTP block only to compute the MTP loss, which needs labels.
    Without post_process it returns the hidden states of the main model and of every depth, concatenated
    along the sequence; the chunk's own output layer turns each into logits.
    """
    if not (chunk.post_process and getattr(chunk, "mtp_process", False)):
        assert not (draft and chunk.post_process), "this model has no MTP block (ModelSpec.mtp_layers=0)"
        return chunk(input_ids=tokens, position_ids=positions, attention_mask=None)
    chunk.post_process = False
    try:
        hidden = chunk(input_ids=tokens, position_ids=positions, attention_mask=None)  # [(1 + D) * S, B, H]
    finally:
        chunk.post_process = True
    weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
    logits, _ = chunk.output_layer(hidden, weight=weight)
    main, *depths = (part.transpose(0, 1) for part in logits.chunk(1 + chunk.config.mtp_num_layers, dim=0))
    return torch.stack(depths) if draft else main


def _pipeline_forward(chunks: list, tokens: torch.Tensor, draft: bool = False) -> torch.Tensor:
    """Run the chunks of every stage in order; return the last stage's local logits on every rank."""
    from megatron.core import parallel_state as ps

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1 and len(chunks) == 1:
        return _run_chunk(chunks[0], tokens, positions, draft)
    rank = ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    hidden_size = chunks[0].config.hidden_size
    hidden_shape = (tokens.shape[1], tokens.shape[0], hidden_size)  # Megatron's [seq, batch, hidden]
    logits = None
    for v in range(len(chunks)):
        for stage in range(pp):
            if stage != rank:
                continue
            chunk = chunks[v]
            if not chunk.pre_process:
                hidden = torch.empty(hidden_shape, dtype=chunk.config.params_dtype)
                torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
                chunk.set_input_tensor(hidden)
            out = _run_chunk(chunk, tokens, positions, draft)
            if chunk.post_process:
                logits = out
            else:
                torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
    last = torch.distributed.get_global_rank(group, pp - 1)
    rank_of = 4 if draft else 3
    shape = torch.tensor(list(logits.shape) if logits is not None else [0] * rank_of)
    torch.distributed.broadcast(shape, src=last, group=group)
    if logits is None:
        logits = torch.empty(tuple(shape.tolist()), dtype=chunks[0].config.params_dtype)
    torch.distributed.broadcast(logits.contiguous(), src=last, group=group)
    return logits
