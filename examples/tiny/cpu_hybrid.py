"""Test-only pieces that let megatron-core 0.16.1 build and run a Qwen3-Next-style hybrid model on CPU.

megatron-core's gated-delta-net layer (`megatron.core.ssm.gated_delta_net.GatedDeltaNet`) is
real and is what these builds use; what 0.16.1 does not offer on CPU is everything around it:

* ``GatedDeltaNet.__init__`` raises ``ImportError: FLA is not installed. Please install it with
  `pip install flash-linear-attention`.``, and its forward calls FLA's Triton kernels (``l2norm``, ``chunk_gated_delta_rule``), which
  need a GPU -> ``HAVE_FLA`` is set, ``l2norm`` is a torch function with FLA's formula
  (``x / sqrt(sum(x^2) + 1e-6)``) and ``chunk_gated_delta_rule`` is megatron-core's own torch
  implementation (``torch_chunk_gated_delta_rule``, the one its ``deterministic_mode`` uses).
* ``GatedDeltaNet.__init__`` / ``reset_parameters`` allocate ``conv1d``, ``dt_bias`` and
  ``A_log`` on ``torch.cuda.current_device()`` -> run with that call answering "cpu".
* ``GatedDeltaNet._apply_gated_norm`` is wrapped in ``torch.compile`` at import (megatron's
  ``jit_fuser``) -> the plain function is used (no C++ toolchain needed, same arithmetic).
* The only block spec for it (``get_transformer_block_with_experimental_attention_variant_spec``)
  needs Transformer Engine (``NameError: name 'TESpecProvider' is not defined`` without it; with
  ``transformer_impl="local"`` it asserts "only supports transformer engine implementation")
  -> :func:`hybrid_block_spec` builds the
  same per-layer pattern from the local (non-TE) spec: a ``GatedDeltaNet`` self-attention on the
  linear-attention layers (separate ``input_layernorm``, as TE's fused
  ``in_proj.layer_norm_weight`` is not available), megatron's standard attention elsewhere.
* Qwen3-Next's norms are zero-centered (``layernorm_zero_centered_gamma=True``: the weight
  stores gamma - 1), which the local spec's torch norm refuses -> :class:`ZeroCenteredRMSNorm`,
  the function TE's ``TENorm`` computes with that flag, stands in for every RMSNorm.

The library never imports this module.
"""

from __future__ import annotations

import dataclasses

import torch

from examples.tiny.cpu_shim import _run_on_cpu

__all__ = ["apply_gated_delta_net_shims", "ZeroCenteredRMSNorm", "hybrid_block_spec"]

_APPLIED = False


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: x / sqrt(sum(x^2) + eps) over `dim`."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def apply_gated_delta_net_shims() -> None:
    """Make megatron-core's GatedDeltaNet build and run on CPU; calling it again is a no-op."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.ssm import gated_delta_net as gdn

    gdn.HAVE_FLA = True
    gdn.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn.GatedDeltaNet.__init__ = _run_on_cpu(gdn.GatedDeltaNet.__init__)
    compiled = gdn.GatedDeltaNet._apply_gated_norm  # the plain function already under TORCHDYNAMO_DISABLE=1
    gdn.GatedDeltaNet._apply_gated_norm = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    _APPLIED = True


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight stores gamma - 1: ``x / rms(x) * (1 + weight)``, computed in float32.

    What Transformer Engine's ``TENorm`` computes under ``layernorm_zero_centered_gamma=True``;
    built like megatron's norms (``config``, ``hidden_size``, ``eps``).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the normalized `x` in its own dtype."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _with_norms(spec, norm):
    """Return a copy of a ModuleSpec (or class) tree with every norm submodule replaced by `norm`."""
    if not dataclasses.is_dataclass(spec):
        return spec
    changes = {}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name in _NORM_FIELDS and value is not None and not _is_identity(value):
            changes[field.name] = norm
        elif dataclasses.is_dataclass(value):
            changes[field.name] = _with_norms(value, norm)
    return dataclasses.replace(spec, **changes)


_NORM_FIELDS = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "out_norm", "layer_norm")


def _is_identity(value) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return value is IdentityOp


def _gated_delta_net_spec():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear,
        ),
    )


def hybrid_block_spec(config, linear_attention: list[bool], *, vp_stage=None, pp_rank=None):
    """Return the local-spec decoder block of a hybrid model: GatedDeltaNet where `linear_attention[i]`
    (global layer index) is True, standard attention elsewhere, every norm zero-centered."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    apply_gated_delta_net_shims()
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank,
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = []
    for i, layer in enumerate(block.layer_specs):
        if linear_attention[offset + i]:
            submodules = dataclasses.replace(layer.submodules, self_attention=_gated_delta_net_spec())
            layer = dataclasses.replace(layer, submodules=submodules)
        layers.append(_with_norms(layer, ZeroCenteredRMSNorm))
    return dataclasses.replace(block, layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)
