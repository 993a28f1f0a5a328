"""One vLLM worker's model as an `EngineAdapter`: full HF tensors in, vLLM's own `load_weights` applies them.

Runs inside a vLLM worker process (imports vLLM). The receiver hands this
adapter a complete, checksum-verified version only after every transport
rank agreed it arrived intact; `load_shards` then applies it through vLLM's
layerwise reload (`initialize_layerwise_reload` -> `model.load_weights` ->
`finalize_layerwise_reload`), the path vLLM's own weight-transfer engines use,
so vLLM fuses q/k/v and gate/up, slices for its own TP, and re-runs each
layer's post-load processing (CPU weight packing, quantization).

Restoring the previous version. vLLM keeps no copy of the weights it
replaces, and `finalize_layerwise_reload` would process a partially received
layer from uninitialised memory. So a failed load never reaches it: the
layers still waiting for weights get their live tensors back untouched, and
the previous version is then *reloaded* through the same layerwise path from
the previous version's checkpoint-format tensors, which this adapter keeps in
host memory (version 0: re-read from the served checkpoint by vLLM's own
loader). The cost is one host copy of the full model per worker between syncs:
the receiver's staged tensors of the last committed version, kept rather than
freed, which are also what `snapshot()` hands the receiver when a load that
succeeded here failed on another rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch

from megatron_sync.meta import TensorMeta, dtype_name

log = logging.getLogger("megatron_sync")

WeightItems = Iterable[tuple[str, torch.Tensor]]


class CheckpointWeights(Mapping):
    """The weights vLLM started with (version 0), re-read from the served checkpoint when iterated.

    A mapping of HF name -> tensor whose `items()` streams the checkpoint
    files; nothing is held in memory between syncs.
    """

    def __init__(self, vllm_config: Any, model: torch.nn.Module, names: list[str]) -> None:
        self._vllm_config, self._model, self._names = vllm_config, model, names

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        for key, tensor in self.items():  # one tensor out of the checkpoint: rare (debugging), so a scan
            if key == name:
                return tensor
        raise KeyError(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """Yield (HF name, tensor) from the checkpoint files through vLLM's own model loader."""
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(self._vllm_config.load_config)
        yield from loader.get_all_weights(self._vllm_config.model_config, self._model)


class VLLMModelAdapter:
    """The `EngineAdapter` of one vLLM worker (one TP/PP rank of the engine)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, worker_rank: int, label: str) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.worker_rank, self.label = worker_rank, label
        self._expected: list[TensorMeta] = []
        self._version = 0
        self._live: Any = None  # the live version's tensors, what a failed load restores

    def configure(self, family: str, dtype: torch.dtype, draft: bool = True) -> None:
        """Derive the expected HF tensors from the served model's config; check the dtype agrees.

        Raises ValueError naming the fix when the trainer's dtype is not the
        one vLLM serves (vLLM would silently cast, and exactness would be lost),
        and when draft (MTP) layers are involved (`_refuse_draft`).
        """
        from converters import get_converter

        model_config = self.vllm_config.model_config
        if model_config.dtype != dtype:
            raise ValueError(
                f"{self.label}: the trainer sends {dtype_name(dtype)} but vLLM serves "
                f"{dtype_name(model_config.dtype)}; start vLLM with --dtype {dtype_name(dtype)} "
                f"or set weight_sync.dtype: {dtype_name(model_config.dtype)}"
            )
        hf_config = model_config.hf_config.to_dict()
        converter = get_converter(family, hf_config, dtype=dtype, draft=draft)
        self._refuse_draft(converter.draft_layers)
        self._expected = converter.expected_metas()
        if self._live is None:
            self._live = CheckpointWeights(self.vllm_config, self.model, [m.name for m in self._expected])

    def _refuse_draft(self, draft_layers: int) -> None:
        """Raise ValueError when a version would carry draft layers, or vLLM runs a draft model: this
        adapter loads vLLM's target model only (the engine vLLM hands a weight-transfer backend), whose
        `load_weights` skips draft-layer names, so a draft would silently keep its old weights."""
        speculative = getattr(self.vllm_config, "speculative_config", None)
        if getattr(speculative, "draft_model_config", None) is not None:
            raise ValueError(
                f"{self.label}: this vLLM server runs a speculative draft model ({speculative.method}), which "
                "megatron_sync's vLLM backend does not update (it loads the target model only); the draft would "
                "keep its start-up weights. Serve without --speculative-config")
        if draft_layers:
            raise ValueError(
                f"{self.label}: the served config declares {draft_layers} draft (MTP) layer(s) "
                "(num_nextn_predict_layers), which vLLM's target model drops on load; set weight_sync.draft: skip "
                "(or num_nextn_predict_layers: 0 in the served config.json)")

    @property
    def version(self) -> int:
        """The version these weights are (0: what vLLM loaded at start-up)."""
        return self._version

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full HF checkpoint tensors the served model consists of."""
        return list(self._expected)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Return the full tensor in host memory: vLLM's loaders take full tensors and slice for TP."""
        return full if full.device.type == "cpu" else full.to("cpu")

    def snapshot(self) -> Mapping:
        """Return the live version's full tensors (no copy: they are kept between syncs), for a rollback."""
        return self._live

    def load_shards(self, shards: Mapping, version: int) -> None:
        """Make `shards` (name -> full tensor, every expected tensor) the live weights, as `version`.

        On failure the previous version is reloaded before the error is
        raised; if even that fails, the error says the worker is unusable.
        """
        try:
            self._load(shards.items())
        except Exception as error:
            self._restore_after(error, version)
            raise
        self._live = shards if isinstance(shards, CheckpointWeights) else dict(shards)
        self._version = version

    def _restore_after(self, error: Exception, version: int) -> None:
        log.error("%s: loading version %d failed (%s); reloading version %d", self.label, version, error,
                  self._version)
        try:
            self._load(self._live.items())
        except Exception as restore_error:
            raise RuntimeError(
                f"{self.label}: loading version {version} failed ({error}) and reloading version "
                f"{self._version} failed too ({restore_error}); this worker's weights are unusable, "
                "restart the vLLM server"
            ) from restore_error

    def _load(self, items: WeightItems) -> None:
        """Run one complete layerwise reload of `items`; never finalize a partially received layer."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload, initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(items)
            problems = _incomplete_layers(self.model)
            if problems:
                raise RuntimeError(
                    f"vLLM's load_weights left {len(problems)} layer(s) incomplete: "
                    f"{problems[:8]} (the trainer's HF names or shapes do not match what this vLLM "
                    "model loads)"
                )
            finalize_layerwise_reload(self.model, self.vllm_config.model_config)
            _prepack_cpu_moe_experts(self.model)
        except BaseException:
            _abandon_layerwise_reload(self.model)  # no-op for layers finalize already processed
            raise
        log.debug("%s: load_weights consumed %d parameters", self.label, len(loaded or ()))


def _incomplete_layers(model: torch.nn.Module) -> list[str]:
    """Return "layer: parameters never loaded" for every layer still waiting for weights after a load.

    A layer that is still waiting although each of its parameters received
    data is short only of padding (vocabulary rows past the real vocabulary);
    `finalize_layerwise_reload` processes it as vLLM intends. Layers without
    parameters (rotary caches) and attention layers (processed at finalize by
    design) are not listed.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    problems = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or is_deferred_attention_layer(layer):
            continue
        params = {p for p, t in layer._parameters.items() if t is not None and p not in SKIP_LOAD_TENSORS}
        missing = sorted(params - {p for p, _ in info.loaded_weights})
        if missing:
            problems.append(f"{name or '<model>'}: {missing} not loaded "
                            f"({info.load_numel}/{info.load_numel_total} elements)")
    return problems


def _abandon_layerwise_reload(model: torch.nn.Module) -> None:
    """Give every layer still in the reload state its live tensors back, unprocessed.

    Layers already processed hold the new weights; the caller reloads a
    complete version over them. Uses vLLM 0.32's `_place_kernel_tensors` (the
    step `finalize_layerwise_reload` takes for a layer that received nothing).
    """
    from vllm.model_executor.model_loader.reload import layerwise

    place = getattr(layerwise, "_place_kernel_tensors", None)
    if place is None:
        raise RuntimeError(
            "this vLLM has no layerwise._place_kernel_tensors (megatron_sync's vLLM backend is "
            "written against vLLM 0.32); a failed load cannot be undone safely with it"
        )
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            if info.kernel_tensors is not None:
                place(layer, info)
            info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()



def _prepack_cpu_moe_experts(model: torch.nn.Module) -> None:
    """Re-run vLLM's CPU MoE weight prepacking after a reload (works around a vLLM 0.32 CPU bug).

    `UnquantizedFusedMoEMethod._setup_kernel` prepacks CPU expert weights into
    the grouped-GEMM layout only on its first call; on a weight update it copies
    the new weights into the packed storage unpacked, and the kernel then reads
    them in the wrong layout (every token after a reload is wrong, even when
    the same weights are reloaded). Each complete reload leaves every MoE
    layer unpacked, so packing each once more restores the layout vLLM built
    at start-up. No-op without vLLM's CPU experts (GPU builds, dense models).
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
