"""Test/demo-only shims that let megatron-core 0.16.1 build and run forward on CPU.

megatron-core assumes CUDA in a handful of places even with its *local*
(non-Transformer-Engine) layer spec. This module patches exactly those places,
and nothing else, so tiny models can be built and run on CPU with gloo:

* ``RotaryEmbedding.__init__`` builds ``inv_freq`` on the current CUDA device unless
  ``use_cpu_initialization`` is passed, which MLA does not -> always passed.
* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
  on the first forward -> the frequencies stay on the device they were built on.
* ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build their
  masks on ``"cuda"`` -> built on CPU (patched where ``fused_softmax`` imported them).
* ``GlobalMemoryBuffer.get_tensor`` (the ``baddbmm`` scratch of ``DotProductAttention``)
  allocates on ``torch.cuda.current_device()`` -> a fresh CPU tensor.
* ``CudaRNGStatesTracker.add`` / ``fork`` read and write the CUDA generator ->
  they keep and swap the CPU generator state, so ``model_parallel_cuda_manual_seed``
  (whose bare ``torch.cuda.manual_seed`` is queued lazily and harmless on CPU) and
  ``get_cuda_rng_tracker().fork()`` work unchanged.
* ``TopKRouter.__init__`` allocates the ``expert_bias`` / ``local_tokens_per_expert``
  buffers on ``torch.cuda.current_device()``, and ``Router.gating`` moves a CPU router
  weight there on every call -> both run with that call answering "cpu".
* ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied output weight
  ``.cuda()`` before the first/last-stage all-reduce (tied embeddings, PP>1) -> run with
  ``Tensor.cuda`` as a no-op, so the all-reduce runs over gloo on CPU.
* ``tensor_parallel.mappings``' gather / reduce-scatter helpers allocate their output on
  ``torch.cuda.current_device()`` (the MoE allgather dispatcher uses them) -> run with
  that call answering "cpu".
* ``_ParamAndGradBuffer.__init__`` (inside ``DistributedDataParallel``) allocates the
  grad/param buffers on ``torch.cuda.current_device()`` -> allocated on CPU, so the real
  DDP wrapper and ``finalize_model_grads`` run over gloo (Megatron's optimizer still
  allocates on "cuda" and is not used on CPU).
* ``DotProductAttention.__init__`` allocates the learnable softmax offset (``softmax_type=
  "learnable"``, gpt-oss's attention sinks) on ``torch.cuda.current_device()`` -> run with
  that call answering "cpu".
* ``MTPLossLoggingHelper.save_loss_to_tracker`` (a training forward of a model with an MTP
  block) allocates its loss tracker on ``torch.cuda.current_device()`` -> run with that call
  answering "cpu".
* ``moe_utils.te_general_gemm`` is referenced by the router GEMM but only defined when
  Transformer Engine imports -> set to ``None`` so the router uses ``torch.mm``.
* ``multi_latent_attention.HAVE_TE`` is True without Transformer Engine (its TE names
  import as stubs) -> reset to False. 0.16.1's ``DotProductAttention`` rejects the
  ``k_channels`` / ``v_channels`` keywords MLA passes, so MLA layer specs must use
  :class:`CPUCoreAttention` instead (see :func:`use_cpu_core_attention`).

The MoE all-to-all dispatcher creates a ``torch.cuda.Stream`` in its constructor;
that is avoided by configuration (``moe_token_dispatcher_type="allgather"``), not
patched here.

The library itself never imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

__all__ = ["apply_cpu_shims", "CPUCoreAttention", "use_cpu_core_attention"]

_APPLIED = False


def apply_cpu_shims() -> None:
    """Patch megatron-core's CUDA-only calls for CPU runs; calling it again is a no-op."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_rotary()
    _patch_causal_masks()
    _patch_memory_buffer()
    _patch_rng_tracker()
    _patch_moe_router_gemm()
    _patch_mla_flag()
    _patch_router_buffers()
    _patch_tied_embedding_setup()
    _patch_tp_collective_buffers()
    _patch_ddp_buffers()
    _patch_attention_sinks()
    _patch_mtp_loss_tracker()
    _APPLIED = True


@contextlib.contextmanager
def _cuda_calls_on_cpu():
    """Within the block, ``torch.cuda.current_device()`` is "cpu" and ``Tensor.cuda()`` a no-op."""
    current_device, tensor_cuda = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda = current_device, tensor_cuda


def _run_on_cpu(method):
    def wrapper(*args, **kwargs):
        with _cuda_calls_on_cpu():
            return method(*args, **kwargs)

    wrapper.__wrapped__ = method
    return wrapper


def _patch_router_buffers() -> None:
    from megatron.core.transformer.moe.router import Router, TopKRouter

    TopKRouter.__init__ = _run_on_cpu(TopKRouter.__init__)
    Router.gating = _run_on_cpu(Router.gating)


def _patch_tp_collective_buffers() -> None:
    from megatron.core.tensor_parallel import mappings

    for name in (
        "_gather_along_last_dim",
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_reduce_scatter_along_last_dim",
    ):
        setattr(mappings, name, _run_on_cpu(getattr(mappings, name)))


def _patch_ddp_buffers() -> None:
    from megatron.core.distributed import param_and_grad_buffer

    cls = param_and_grad_buffer._ParamAndGradBuffer
    cls.__init__ = _run_on_cpu(cls.__init__)


def _patch_attention_sinks() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    DotProductAttention.__init__ = _run_on_cpu(DotProductAttention.__init__)


def _patch_mtp_loss_tracker() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.save_loss_to_tracker = staticmethod(
        _run_on_cpu(MTPLossLoggingHelper.save_loss_to_tracker))


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _run_on_cpu(
        LanguageModule.setup_embeddings_and_output_layer
    )


def _patch_rotary() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # Same result as megatron's get_emb, minus the move to the current CUDA device.
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1)
            emb = emb.view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    original_init = RotaryEmbedding.__init__

    def __init__(self, *args, **kwargs):
        # MLA builds its RotaryEmbedding without passing use_cpu_initialization.
        kwargs["use_cpu_initialization"] = True
        original_init(self, *args, **kwargs)

    RotaryEmbedding.__init__ = __init__
    RotaryEmbedding.get_emb = get_emb


def _causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_mask_cpu(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _patch_causal_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for module in (utils, fused_softmax):
        module.get_default_causal_mask = _causal_mask_cpu
        module.get_sliding_window_causal_mask = _sliding_window_mask_cpu


def _patch_memory_buffer() -> None:
    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        # Callers overwrite the buffer (baddbmm with beta=0), so a fresh tensor is equivalent.
        return torch.empty(tuple(tensor_shape), dtype=dtype)

    GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


def _patch_moe_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False):
        moe_utils.te_general_gemm = None


def _patch_mla_flag() -> None:
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        multi_latent_attention.HAVE_TE = False


class CPUCoreAttention(torch.nn.Module):
    """Causal softmax attention for CPU runs, with key and value head sizes that may differ.

    Takes Megatron's core-attention inputs ``query [sq, b, np, hk]``, ``key [sk, b, ng, hk]``,
    ``value [sk, b, ng, hv]`` and returns ``[sq, b, np * hv]``. Only the causal mask type
    is supported (padding masks and packed sequences raise).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        **unused,
    ):
        super().__init__()
        self.config = config
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused,
    ):
        """Return causal softmax(q k^T * scale) v as ``[sq, b, heads * v_head_dim]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("CPUCoreAttention supports plain causal attention only")
        sq, b, nh, _ = query.shape
        groups = key.shape[2]
        if nh != groups:
            key = key.repeat_interleave(nh // groups, dim=2)
            value = value.repeat_interleave(nh // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, h, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        sk = k.shape[2]
        future = torch.triu(torch.ones(sq, sk, dtype=torch.bool), diagonal=sk - sq + 1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def use_cpu_core_attention(layer_spec):
    """Return a copy of a TransformerLayer ModuleSpec whose core attention is CPUCoreAttention."""
    attention = layer_spec.submodules.self_attention
    attn_submodules = dataclasses.replace(attention.submodules, core_attention=CPUCoreAttention)
    attention = dataclasses.replace(attention, submodules=attn_submodules)
    layer_submodules = dataclasses.replace(layer_spec.submodules, self_attention=attention)
    return dataclasses.replace(layer_spec, submodules=layer_submodules)
