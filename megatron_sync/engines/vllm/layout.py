"""A vLLM worker's rank layout, recorded from vLLM's own weight loaders, and a load that writes through it.

Recording (once per worker, at join): every layer's parameters are put back on
the meta device in checkpoint layout (vLLM's own reload metadata, the shapes
`load_weights` fills), the served model's `load_weights` runs over meta
stand-ins of the full HF checkpoint tensors, and every `copy_` a loader makes
is recorded instead of run: which region of which checkpoint tensor (a strided
view of the stand-in) lands in which region of which parameter. Nothing is
allocated or written; the live tensors are put back afterwards. The result is
the worker's `RankLayout`: exactly the bytes this worker needs, in vLLM's fused
q/k/v, gate/up and expert layouts, with its TP slices, its replicated KV heads,
its padded vocabulary block, its experts under EP and its layers under PP, for
any family vLLM can load, with no table of ours.

Loading (`load_params`): vLLM's layerwise reload restores each layer in
checkpoint layout; the staged params are copied in (one copy), the layer's
post-load processing runs (CPU weight packing, requantization) and the result
goes into the live storage, as `load_weights` would have left it; a layer that
shares a parameter with another (a tied lm_head) is processed again too. An attention
layer's own params (gpt-oss's sinks), which vLLM processes at finalize, are
copied into the live tensors after it and processed again.

Uses vLLM 0.32's reload internals (`reload.layerwise`, `reload.meta`), like the
adapter; a vLLM without them raises a RuntimeError naming what is missing.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sync.layout.rank import ParamSpec, Placement, RankLayout, placements_of_copy
from megatron_sync.layout.regions import Region
from megatron_sync.core.meta import TensorMeta


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identify the storage a tensor views (meta storages by identity, real ones by address)."""
    storage = tensor.untyped_storage()
    return ("meta", storage._cdata) if tensor.is_meta else ("real", storage.data_ptr())


def _region(view: torch.Tensor) -> Region:
    return Region(view.storage_offset(), tuple(view.shape), tuple(view.stride()))


def fit_region(indices: torch.Tensor) -> Optional[Region]:
    """Return the strided region whose elements are the flat `indices` (same shape), or None when they are
    not an arithmetic progression along every dim with non-negative steps."""
    if indices.numel() == 0:
        return Region(0, tuple(indices.shape), tuple(indices.stride()))
    offset = int(indices.flatten()[0])
    strides = [int((indices.narrow(d, 1, 1) - indices.narrow(d, 0, 1)).flatten()[0]) if n > 1 else 0
               for d, n in enumerate(indices.shape)]
    if any(st < 0 for st in strides):
        return None
    region = Region(offset, tuple(indices.shape), tuple(strides))
    positions = torch.arange(offset + sum((n - 1) * st for n, st in zip(indices.shape, strides)) + 1)
    return region if torch.equal(region.of(positions), indices) else None


class _RecordCopies(TorchDispatchMode):
    """Records every `copy_` into a known parameter from (a view of) a known stand-in; runs nothing else
    that writes a parameter.

    A loader that rearranges a checkpoint tensor into a new one first (`.t().contiguous()`, a reshape
    that copies) is followed too: the new tensor's storage gets an index map (which element of the
    stand-in each of its elements is), and a copy out of it is recorded when those elements form a
    strided region of the stand-in.
    """

    _REARRANGING = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)

    def __init__(self, params: Mapping[tuple[str, int], str], sources: Mapping[tuple[str, int], str]) -> None:
        super().__init__()
        self.params, self.sources = params, sources
        self.derived: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}  # storage -> (hf name, index map)
        self.copies: list[tuple[str, Region, str, Region]] = []  # (param, dest, hf name, source)
        self.problems: list[str] = []

    def _source(self, view: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
        """Return (hf name, flat stand-in indices of `view`'s elements), if `view` comes from a stand-in."""
        if not view.is_meta:
            return None
        key = _storage_key(view)
        if key in self.sources:
            return self.sources[key], None
        if key in self.derived:
            name, flat = self.derived[key]
            return name, flat.as_strided(tuple(view.shape), tuple(view.stride()), view.storage_offset())
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dest, source = args[0], args[1]
            param = self.params.get(_storage_key(dest))
            if param is not None:
                self._record(param, dest, source)
                return dest
        elif func in self._REARRANGING and args and isinstance(args[0], torch.Tensor):
            found = self._source(args[0])
            out = func(*args, **kwargs)
            if found is not None and out.dtype == args[0].dtype:
                name, indices = found
                if indices is None:
                    stand_in = torch.arange(args[0].untyped_storage().nbytes() // args[0].element_size())
                    indices = stand_in.as_strided(tuple(args[0].shape), tuple(args[0].stride()), args[0].storage_offset())
                self.derived[_storage_key(out)] = (name, indices.contiguous().flatten())
            return out
        elif func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) \
                and _storage_key(args[0]) in self.params:
            zeroing = func is torch.ops.aten.zero_.default or (func is torch.ops.aten.fill_.Scalar and args[1] == 0)
            if not zeroing:  # zeros are what staging holds where no region lands (vocabulary padding rows)
                self.problems.append(f"{self.params[_storage_key(args[0])]}: vLLM's loader writes it with {func} "
                                     "(only copies of checkpoint regions and zeros can be recorded)")
            return args[0]
        return func(*args, **kwargs)

    def _record(self, param: str, dest: torch.Tensor, source: torch.Tensor) -> None:
        found = self._source(source)
        region = None
        if found is not None:
            name, indices = found
            region = _region(source) if indices is None else fit_region(indices.contiguous())
        if region is None:
            self.problems.append(f"{param}: vLLM's loader copies a tensor derived from a checkpoint tensor in a way "
                                 "the recorder cannot follow (not a strided rearrangement of it)")
            return
        self.copies.append((param, _region(dest), name, region))


def _reload_api() -> Any:
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    except ImportError as e:
        raise RuntimeError(f"this vLLM has no layerwise reload ({e}); megatron_sync's vLLM backend is written "
                           "against vLLM 0.32") from e
    for module, attr in ((layerwise, "_place_kernel_tensors"), (layerwise, "_layerwise_process"),
                         (layerwise, "_get_original_loader"),
                         (meta, "restore_layer_on_meta"), (meta, "materialize_layer")):
        if not hasattr(module, attr):
            raise RuntimeError(f"this vLLM has no {module.__name__}.{attr}; megatron_sync's vLLM backend is "
                               "written against vLLM 0.32")
    return layerwise, meta, utils


@contextlib.contextmanager
def original_loaders(model: torch.nn.Module):
    """Within the block, every parameter's `weight_loader` is vLLM's own, not the layerwise-reload wrapper
    an earlier reload left on the (reused) checkpoint-layout tensors; the wrappers are put back after."""
    layerwise, _, _ = _reload_api()
    wrapped = [(p, p.weight_loader) for p in model.parameters()
               if getattr(getattr(p, "weight_loader", None), "__name__", "") == "online_process_loader"]
    for param, _ in wrapped:
        param.weight_loader = layerwise._get_original_loader(param)
    try:
        yield
    finally:
        for param, loader in wrapped:
            param.weight_loader = loader


def alias_names(model: torch.nn.Module) -> set[str]:
    """Return the names under which a parameter already seen under another name is registered again
    (a tied lm_head is the embedding's parameter): vLLM loads such a parameter once."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return aliases


def record_rank_layout(model: torch.nn.Module, checkpoint: Iterable[TensorMeta], *, who: str) -> RankLayout:
    """Return this worker's layout: dry-run `model.load_weights` over meta stand-ins of `checkpoint`.

    Raises ValueError naming every parameter vLLM's loaders would write in a way that cannot be
    recorded, and every parameter no checkpoint tensor fills (a tensor the trainer does not send);
    an attention layer's own parameters (KV-cache scales, which vLLM defaults when a checkpoint has
    none) are exempt from the second check.
    """
    layerwise, meta, utils = _reload_api()
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    aliases = alias_names(model)
    kept = []
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        kept.append((layer, info, utils.get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
        meta.restore_layer_on_meta(layer, info)
    try:
        params = {name: p for name, p in model.named_parameters(remove_duplicate=False) if name not in aliases}
        keys = {_storage_key(p): name for name, p in params.items()}
        stand_ins, sources = [], {}
        checkpoint_metas = list(checkpoint)
        for m in checkpoint_metas:
            stand_in = torch.empty(m.shape, dtype=m.dtype, device="meta")
            sources[_storage_key(stand_in)] = m.name
            stand_ins.append((m.name, stand_in))
        recorder = _RecordCopies(keys, sources)
        with original_loaders(model), recorder, torch.no_grad():
            model.load_weights(iter(stand_ins))
        specs = {name: ParamSpec(name, tuple(p.shape), p.dtype) for name, p in params.items()}
        modules = dict(model.named_modules())
        loadable = {name for name, p in params.items() if name.rpartition(".")[2] not in meta.SKIP_LOAD_TENSORS
                    and utils.get_tensor_load_numel(p) > 0
                    and not is_deferred_attention_layer(modules[name.rpartition(".")[0]])}
    finally:
        for layer, info, kernel, non_persistent in kept:
            info.kernel_tensors, info.kernel_non_persistent_buffers = kernel, non_persistent
            layerwise._place_kernel_tensors(layer, info)
            info.reset()
    if recorder.problems:
        raise ValueError(f"{who}: {len(recorder.problems)} parameter write(s) cannot be recorded: "
                         f"{'; '.join(recorder.problems[:6])}")
    return _layout_of(recorder.copies, specs, loadable, {m.name: m.dtype for m in checkpoint_metas}, who=who)


def _staged_dtypes(copies, specs: Mapping[str, ParamSpec], dtypes: Mapping[str, torch.dtype], *,
                   who: str) -> dict[str, ParamSpec]:
    """Return the params as staged: in the dtype of the checkpoint tensors copied into them. A loader's
    `copy_` may cast (Qwen3-Next keeps A_log in float32 under a bfloat16 checkpoint); the staging holds the
    bytes as sent, and the load's copy into the parameter casts them as vLLM's loader would."""
    sources: dict[str, set[torch.dtype]] = defaultdict(set)
    for param, _, name, _ in copies:
        sources[param].add(dtypes[name])
    staged = dict(specs)
    for param, found in sources.items():
        if len(found) > 1:
            raise ValueError(f"{who}: {param} is filled from checkpoint tensors of different dtypes {sorted(map(str, found))}")
        (dtype,) = found
        if dtype != specs[param].dtype:
            staged[param] = ParamSpec(param, specs[param].shape, dtype)
    return staged


def _layout_of(copies, specs: Mapping[str, ParamSpec], loadable: set[str], dtypes: Mapping[str, torch.dtype], *,
               who: str) -> RankLayout:
    """Return the layout of the recorded copies; a later copy over the same bytes replaces the earlier."""
    specs = _staged_dtypes(copies, specs, dtypes, who=who)
    by_param: dict[str, list[Placement]] = defaultdict(list)
    for param, dest, name, source in copies:
        for placement in placements_of_copy(name, source, specs[param], dest):
            kept = by_param[param]
            start, end = placement.offset, placement.offset + placement.nbytes
            for old in list(kept):
                if start <= old.offset and old.offset + old.nbytes <= end:
                    kept.remove(old)  # overwritten (vLLM loads INT4 weight_shape once per q/k/v)
                elif old.offset < end and start < old.offset + old.nbytes:
                    raise ValueError(f"{who}: {old.name} and {name} both write part of the same bytes of {param}")
            kept.append(placement)
    unfilled = sorted(loadable - set(by_param))
    if unfilled:
        raise ValueError(f"{who}: {len(unfilled)} parameter(s) of the served model receive nothing from the HF "
                         f"checkpoint tensors the trainer sends: {unfilled[:8]}; the trainer's family and HF "
                         "config must be the served model's")
    order = [name for name in specs if name in by_param]
    placements = [p for name in order for p in sorted(by_param[name], key=lambda p: p.offset)]
    return RankLayout(tuple(specs[name] for name in order), tuple(placements))


def load_params(model: torch.nn.Module, model_config: Any, params: Mapping[str, torch.Tensor]) -> None:
    """Make `params` (by parameter name, in checkpoint layout: the recorded layout's params, a layer's
    params next to each other) the live weights through vLLM's layerwise reload: layer by layer, as the
    params come, each layer's params are copied in, processed, and put into the live storage. On failure
    every layer not yet processed gets its live tensors back untouched, and `PartialLoad` tells whether
    any layer was changed."""
    layerwise, meta, _ = _reload_api()
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    modules = dict(model.named_modules())
    done: set[str] = set()
    attention: dict[str, dict[str, torch.Tensor]] = {}  # vLLM processes attention layers last, at finalize

    def process(module_name: str, tensors: dict[str, torch.Tensor]) -> None:
        layer = modules[module_name]
        if module_name in done or module_name in attention:
            raise ValueError(f"{module_name}: its parameters {sorted(tensors)} are not next to each other")
        if is_deferred_attention_layer(layer):
            attention[module_name] = tensors
            return
        info = layerwise.get_layerwise_info(layer)
        meta.materialize_layer(layer, info)
        with torch.no_grad():
            for attr, tensor in tensors.items():
                getattr(layer, attr).data.copy_(tensor)
        done.add(module_name)
        layerwise._layerwise_process(layer, info)

    layerwise.initialize_layerwise_reload(model)
    try:
        for module_name, tensors in _by_layer(params):
            process(module_name, tensors)
        for layer in model.modules():  # layers that receive nothing (a tied lm_head) keep their live tensors
            info = layerwise.get_layerwise_info(layer)
            if info.can_load() and info.load_numel == 0 and not is_deferred_attention_layer(layer):
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        layerwise.finalize_layerwise_reload(model, model_config)
        refresh_alias_layers(model)
        for module_name, tensors in attention.items():  # attention sinks: into the live tensors, then processed
            layer = modules[module_name]
            with torch.no_grad():
                for attr, tensor in tensors.items():
                    getattr(layer, attr).data.copy_(tensor)
            done.add(module_name)
            layer.process_weights_after_loading(model_config.dtype)
    except BaseException as error:
        abandon_layerwise_reload(model)
        raise PartialLoad(bool(done)) from error


def _by_layer(params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield (module name, its params by attribute) for each run of params of one module, in order."""
    current, tensors = None, {}
    for name, tensor in params.items():
        module_name, _, attr = name.rpartition(".")
        if module_name != current and current is not None:
            yield current, tensors
            tensors = {}
        current, tensors[attr] = module_name, tensor
    if current is not None:
        yield current, tensors


def refresh_alias_layers(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of every layer that holds another layer's parameter (a tied lm_head):
    the reload updated the parameter through its owner, but on CPU each layer packs its own copy of the
    weight for its GEMM, and the alias's copy would keep the previous version. A layer registered twice
    (a MoE gate under `mlp` and `mlp.experts`) is one layer, already processed."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    owners: dict[int, torch.nn.Module] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        layer = model.get_submodule(name.rpartition(".")[0])
        owner = owners.setdefault(id(param), layer)
        method = getattr(layer, "quant_method", None)
        if owner is not layer and isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(layer)


class PartialLoad(RuntimeError):
    """A load that failed; `changed` says whether some layer already holds new weights."""

    def __init__(self, changed: bool) -> None:
        super().__init__("some layers were loaded before the failure" if changed else "no layer was changed")
        self.changed = changed


def abandon_layerwise_reload(model: torch.nn.Module) -> None:
    """Give every layer still in the reload state its live tensors back, unprocessed.

    Layers already processed hold the new weights; the caller reloads a complete version over them.
    """
    layerwise, _, _ = _reload_api()
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()
