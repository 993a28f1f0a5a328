"""One vLLM worker's model as an `EngineAdapter`: it receives and keeps only its own shard.

Runs inside a vLLM worker process (imports vLLM). At join the adapter records
its rank layout from vLLM's own weight loaders (`layout.record_rank_layout`):
which region of which HF checkpoint tensor lands where in this worker's
parameters (fused q/k/v and gate/up, its TP slices, its experts under EP, its
layers under PP). Every transport writes exactly those bytes into a staging
set of this worker's params; once every transport rank agreed they arrived
intact, `load_shards` applies them through vLLM's layerwise reload
(`layout.load_params`: restore each layer in checkpoint layout, copy the
staged params in, run its post-load processing: CPU weight packing,
quantization), so the served weights are exactly what `load_weights` of the
full tensors would have made.

A speculative MTP draft (`draft.py`) is part of the worker's layout once vLLM
hands it over (`attach_draft`, from its draft session): a version loads the
target's params, then (`between_models`, the worker's hook: it waits for
vLLM's draft session) the draft's, and a failure anywhere restores both.

Restoring the previous version. vLLM keeps no copy of the weights it
replaces. A load that fails before any layer changed leaves the worker as it
was; one that fails after gives the layers still waiting their live tensors
back and then *reloads* the previous version through the same path: from the
previous version's staged params, which the receiver keeps (with one staging
set, what `staging_sets: auto` takes for vLLM, the receiver's host copy of it,
`StagedCopy.previous`; with two, its other set: at most this worker's own
shard, nothing copied), or, for version 0, re-read from the served checkpoint
by vLLM's own loader (nothing held).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional

import torch

from megatron_sync.convert import get_converter
from megatron_sync.engines.vllm.draft import DraftModel, split_draft
from megatron_sync.engines.vllm.layout import (
    PartialLoad, abandon_layerwise_reload, alias_names, load_params, record_rank_layout, refresh_alias_layers,
)
from megatron_sync.layout.rank import RankLayout
from megatron_sync.layout.staging import StagedCopy
from megatron_sync.core.meta import TensorMeta, dtype_name

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
    """The `EngineAdapter` of one vLLM worker (one TP/PP/EP rank of the engine)."""

    copies_shards = True
    """vLLM copies every version into its own weights (its layerwise reload): `staging_sets: auto` is one set."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, worker_rank: int, label: str) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.worker_rank, self.label = worker_rank, label
        self._expected: list[TensorMeta] = []
        self._layout: Optional[RankLayout] = None
        self._version = 0
        self._live: Any = None  # the live version's params (or version 0's checkpoint), what a failed load restores
        self.draft: Optional[DraftModel] = None  # vLLM's speculative MTP draft, once handed over (`attach_draft`)
        self.between_models: Optional[Any] = None  # called with the version after the target loaded, before the draft

    def attach_draft(self, model: torch.nn.Module, model_config: Any) -> None:
        """Take vLLM's speculative draft model (what its draft session targets) as part of every version
        (from the next `configure` on; the same model again changes nothing)."""
        if self.draft is None or self.draft.model is not model:
            self.draft = DraftModel(model, model_config)

    def configure(self, family: str, dtype: torch.dtype, draft: bool = True) -> None:
        """Derive the expected HF tensors from the served model's config, check the dtype agrees, and record
        this worker's layout from vLLM's loaders (the draft's too, when it runs one: `draft.py`).

        Raises ValueError naming the fix when the trainer's dtype is not the one vLLM serves (vLLM would
        silently cast, and exactness would be lost), when a draft could not be updated (`_check_draft`),
        or when vLLM's loaders need a tensor the trainer's family does not produce.
        """
        model_config = self.vllm_config.model_config
        if model_config.dtype != dtype:
            raise ValueError(
                f"{self.label}: the trainer sends {dtype_name(dtype)} but vLLM serves "
                f"{dtype_name(model_config.dtype)}; start vLLM with --dtype {dtype_name(dtype)} "
                f"or set weight_sync.dtype: {dtype_name(model_config.dtype)}"
            )
        hf_config = model_config.hf_config.to_dict()
        converter = get_converter(family, hf_config, dtype=dtype, draft=draft)
        self._check_draft(converter.draft_layers, draft)
        self._expected = converter.expected_metas()
        self._layout = record_rank_layout(self.model, self._expected, who=self.label)
        if self.draft is not None:
            drafted = self.draft.record(self.model, self._expected, hf_config["num_hidden_layers"], who=self.label)
            self._layout = RankLayout(self._layout.params + drafted.params,
                                      self._layout.placements + drafted.placements)
        self._layout.check_against({m.name: m for m in self._expected}, who=self.label)
        if self._live is None:
            self._live = CheckpointWeights(self.vllm_config, self.model, [m.name for m in self._expected])

    def _check_draft(self, draft_layers: int, draft: bool) -> None:
        """Raise ValueError when a draft would keep stale weights: vLLM runs a draft other than the model's
        own MTP layers, or an MTP draft this worker was not handed or the trainer does not send
        (`weight_sync.draft: skip`); or the served config declares draft layers and vLLM runs none (its
        target model drops them on load)."""
        speculative = getattr(self.vllm_config, "speculative_config", None)
        if getattr(speculative, "draft_model_config", None) is not None:
            if speculative.method != "mtp":
                raise ValueError(
                    f"{self.label}: this vLLM server runs a speculative draft model ({speculative.method}) that is "
                    "not the served model's own draft (MTP) layers: the trainer does not train it, so it would "
                    "keep its start-up weights. Serve without --speculative-config, or with "
                    "'{\"method\": \"mtp\", ...}'")
            if not draft:
                raise ValueError(
                    f"{self.label}: this vLLM server runs an MTP draft, but weight_sync.draft is 'skip': the draft "
                    "would keep its start-up weights. Set weight_sync.draft: sync (or serve without "
                    "--speculative-config)")
            if self.draft is None:
                raise ValueError(
                    f"{self.label}: this vLLM server runs an MTP draft this worker was not handed: open a draft "
                    "session (/start_draft_weight_update, then /finish_weight_update) before "
                    "/init_weight_transfer_engine, as megatron_sync's vLLM client does")
        elif draft_layers:
            raise ValueError(
                f"{self.label}: the served config declares {draft_layers} draft (MTP) layer(s) "
                "(num_nextn_predict_layers), which vLLM's target model drops on load; set weight_sync.draft: skip, "
                "or serve the draft (--speculative-config '{\"method\": \"mtp\", ...}')")

    @property
    def version(self) -> int:
        """The version these weights are (0: what vLLM loaded at start-up)."""
        return self._version

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full HF checkpoint tensors the served model (every worker together) consists of."""
        return list(self._expected)

    def rank_layout(self) -> RankLayout:
        """Return this worker's layout, recorded from vLLM's loaders at `configure`."""
        if self._layout is None:
            raise RuntimeError(f"{self.label}: configure() first (the layout is recorded when the worker joins)")
        return self._layout

    def snapshot(self) -> Mapping:
        """Return the live version's params (no copy: the receiver keeps them), or version 0's checkpoint; None
        when they lay in a receiver's only staging set, which the next version overwrites (the receiver's host
        copy is the rollback source then)."""
        return None if isinstance(self._live, StagedCopy) else self._live

    def loaded_params(self) -> Optional[dict[str, torch.Tensor]]:
        """Return what this worker computes with, by layout param name: vLLM's own parameter where it keeps
        the checkpoint form after loading (shape and dtype as laid out, not repacked by a fused-MoE or a
        quantized method), else the values handed to vLLM's processing; None before any version."""
        if self._layout is None or not isinstance(self._live, Mapping) or isinstance(self._live, CheckpointWeights):
            return None
        modules = dict(self.model.named_modules())
        held = {}
        for spec in self._layout.params:
            module_name, _, attr = spec.name.rpartition(".")
            module = modules.get(module_name)
            live = getattr(module, attr, None) if module is not None else None
            kept = (isinstance(live, torch.Tensor) and tuple(live.shape) == tuple(spec.shape)
                    and live.dtype == spec.dtype and not _repacks(module))
            held[spec.name] = live if kept else self._live[spec.name]
        return held

    def load_shards(self, shards: Mapping, version: int) -> None:
        """Make `shards` the live weights, as `version`: this worker's params (by the layout's param names),
        or the served checkpoint (`CheckpointWeights`, version 0).

        On failure the previous version is restored before the error is raised (see the module doc); the
        error says what state the worker is in.
        """
        try:
            self._load(shards, version)
        except Exception as error:
            self._restore_after(error, version, self._previous(shards))
            raise RuntimeError(f"{self.label}: loading version {version} failed ({_cause(error)}); "
                               f"{self._restored}") from error
        self._live = shards
        self._version = version

    def _load(self, shards: Mapping, version: int) -> None:
        """Load the target's params, then (after `between_models`) the draft's; version 0 from the checkpoint."""
        if isinstance(shards, CheckpointWeights):
            self._load_checkpoint(shards.items())
            draft = self.draft.params_of(shards) if self.draft is not None else {}
        else:
            target, draft = (shards, {}) if self.draft is None else split_draft(shards)
            load_params(self.model, self.vllm_config.model_config, target)
        _prepack_cpu_moe_experts(self.model)
        if self.draft is None:
            return
        try:
            if self.between_models is not None:
                self.between_models(version)
            self.draft.load(self.model, draft)
            _prepack_cpu_moe_experts(self.draft.model)
        except Exception as error:  # the target's layers hold the new version already: restored by the caller
            raise PartialLoad(True) from ((error.__cause__ or error) if isinstance(error, PartialLoad) else error)

    def _previous(self, shards: Mapping) -> Optional[Mapping]:
        """Return the live version's params as they are while `shards` load: those the worker last loaded,
        unless they lay in the receiver's only staging set, which may hold another version by now: then the
        receiver's host copy handed with `shards`, if any."""
        if isinstance(self._live, StagedCopy):
            return getattr(shards, "previous", None)  # a StagedCopy's, or that of a wrapper passing it on
        return self._live

    def _restore_after(self, error: Exception, version: int, previous: Optional[Mapping]) -> None:
        """Bring the worker back to the live version (`previous`: its params) after a failed load; set
        `_restored` to what happened."""
        if isinstance(error, PartialLoad) and not error.changed:
            self._restored = f"no layer had changed: this worker still serves version {self._version}"
            return
        log.error("%s: loading version %d failed (%s); reloading version %d", self.label, version, _cause(error),
                  self._version)
        hook, self.between_models = self.between_models, None  # restoring waits for nobody
        try:
            if previous is None:
                raise RuntimeError(f"no intact copy of version {self._version} is left (it lay in the receiver's "
                                   "only staging set, which holds another version now)")
            self._load(previous, self._version)
        except Exception as restore_error:
            raise RuntimeError(
                f"{self.label}: loading version {version} failed ({_cause(error)}) and reloading version "
                f"{self._version} failed too ({_cause(restore_error)}); this worker's weights are unusable, "
                "restart the vLLM server"
            ) from restore_error
        finally:
            self.between_models = hook
        self._restored = f"reloaded version {self._version}, which this worker serves again"

    def _load_checkpoint(self, items: WeightItems) -> None:
        """Run one complete layerwise reload of full checkpoint tensors through `load_weights`; never
        finalize a partially received layer."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        aliases = alias_names(self.model)  # of the live model: the reload gives each layer its own tensors
        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(items)
            problems = _incomplete_layers(self.model, aliases)
            if problems:
                raise RuntimeError(
                    f"vLLM's load_weights left {len(problems)} layer(s) incomplete: "
                    f"{problems[:8]} (the checkpoint's HF names or shapes do not match what this vLLM "
                    "model loads)"
                )
            finalize_layerwise_reload(self.model, self.vllm_config.model_config)
            refresh_alias_layers(self.model)
        except BaseException:
            abandon_layerwise_reload(self.model)  # no-op for layers finalize already processed
            raise
        log.debug("%s: load_weights consumed %d parameters", self.label, len(loaded or ()))


def _repacks(module: torch.nn.Module) -> bool:
    """True when vLLM's processing after a load rewrites this module's weights in another form (fused MoE
    experts packed for the CPU kernel, quantized methods), so the check looks at the values handed to it."""
    method = getattr(module, "quant_method", None)
    name = type(method).__name__ if method is not None else ""
    fused_moe = "MoE" in name or any(word in type(module).__name__ for word in ("MoE", "Experts"))
    return fused_moe or (bool(name) and not name.startswith("Unquantized"))


def _cause(error: BaseException) -> str:
    """Return the message of the error behind a `PartialLoad` (or of `error` itself)."""
    inner = error.__cause__ if isinstance(error, PartialLoad) and error.__cause__ is not None else error
    return f"{type(inner).__name__}: {inner}"


def _incomplete_layers(model: torch.nn.Module, aliases: set[str]) -> list[str]:
    """Return "layer: parameters never loaded" for every layer still waiting for weights after a load.

    A layer that is still waiting although each of its parameters received
    data is short only of padding (vocabulary rows past the real vocabulary);
    `finalize_layerwise_reload` processes it as vLLM intends. Layers without
    parameters (rotary caches), attention layers (processed at finalize by
    design) and layers whose parameters are another layer's (a tied lm_head:
    vLLM loads the embedding once) are not listed.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    problems = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or is_deferred_attention_layer(layer):
            continue
        params = {p for p, t in layer._parameters.items() if t is not None and p not in SKIP_LOAD_TENSORS
                  and f"{name}.{p}".lstrip(".") not in aliases}
        missing = sorted(params - {p for p, _ in info.loaded_weights})
        if missing:
            problems.append(f"{name or '<model>'}: {missing} not loaded "
                            f"({info.load_numel}/{info.load_numel_total} elements)")
    return problems


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
