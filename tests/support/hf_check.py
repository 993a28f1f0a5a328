"""Independent check of synced weights: load them into Hugging Face transformers and run its forward.

The weights go through transformers' own checkpoint path (``model.safetensors`` +
``config.json`` in a directory, then ``AutoModelForCausalLM.from_pretrained``), not
``load_state_dict`` on an instantiated model: transformers 5 keeps MoE experts
fused in memory and converts per-expert checkpoint names on load, so only the
checkpoint path checks the HF *checkpoint* names the megatron_sync.convert promise.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, Iterable

import torch

__all__ = ["HFLoadReport", "hf_logits_from_checkpoint", "transformers_checkpoint", "StreamedCase", "stream_and_check"]

# Checkpoints that transformers keeps stacked over experts where the sync sends one tensor per expert
# (gpt-oss): per-expert pattern -> stacked pattern. Stacking over `{expert}` is the whole difference.
_STACKED_EXPERTS = tuple(
    (f"model.layers.{{layer}}.mlp.experts.{{expert}}.{kind}", f"model.layers.{{layer}}.mlp.experts.{kind}")
    for kind in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
)


def transformers_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return `tensors` as transformers' checkpoint of the family spells them: per-expert gpt-oss tensors
    stacked over experts in expert order (every other tensor as it is)."""
    from megatron_sync.convert.patterns import compile_pattern

    out, stacks = {}, {}
    for name, tensor in tensors.items():
        for per_expert, stacked in _STACKED_EXPERTS:
            captures = compile_pattern(per_expert).match(name)
            if captures is not None:
                stacks.setdefault(compile_pattern(stacked).format(**captures), {})[captures["expert"]] = tensor
                break
        else:
            out[name] = tensor
    for name, experts in stacks.items():
        assert sorted(experts) == list(range(len(experts))), f"{name}: experts {sorted(experts)} are not 0..E-1"
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


@dataclasses.dataclass(frozen=True)
class HFLoadReport:
    """What ``from_pretrained`` said about the checkpoint, plus the logits it computed."""

    logits: torch.Tensor
    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]
    model_class: str

    @property
    def problems(self) -> list[str]:
        """Return one line per key that did not load cleanly (empty when the checkpoint was exact)."""
        return ([f"missing {k}" for k in self.missing_keys]
                + [f"unexpected {k}" for k in self.unexpected_keys]
                + [f"mismatched {k}" for k in self.mismatched_keys])


def hf_logits_from_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], config: Any,
                              tokens: torch.Tensor) -> HFLoadReport:
    """Return transformers' float32 logits ``[batch, seq, vocab]`` for ``tokens`` with ``tensors`` loaded.

    ``tensors`` are ``(hf_name, tensor)`` pairs in checkpoint naming (for example a
    ``MegatronWeightStream``'s output; per-expert gpt-oss tensors are stacked, see
    ``transformers_checkpoint``); ``config`` is the family's ``PretrainedConfig``.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = transformers_checkpoint({name: t.detach().to(torch.float32).contiguous() for name, t in tensors})
    with tempfile.TemporaryDirectory(prefix="hf_check_") as tmp:
        save_file(state, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True
        )
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits
    return HFLoadReport(
        logits=logits.float(),
        missing_keys=sorted(info.get("missing_keys", ())),
        unexpected_keys=sorted(info.get("unexpected_keys", ())),
        mismatched_keys=sorted(str(k) for k in info.get("mismatched_keys", ())),
        model_class=type(model).__name__,
    )


@dataclasses.dataclass(frozen=True)
class StreamedCase:
    """One tiny model's Megatron logits, the HF tensors the library streamed from it, and transformers' report."""

    megatron: torch.Tensor
    tensors: dict[str, torch.Tensor]
    report: HFLoadReport


def stream_and_check(spec: Any, seed: int, tokens: torch.Tensor) -> StreamedCase | None:
    """Build `spec`'s tiny Megatron model under the current parallel_state with `reference_weights(spec,
    seed)`, run Megatron's forward on `tokens`, stream its weights through the library's gather + convert
    (float32, no rounding added) and load them into transformers. Collective; None on non-source ranks."""
    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models

    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=seed), spec)
    megatron = models.megatron_logits(chunks, tokens)
    config = models.hf_config(spec)
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(),
                                  get_converter(spec.family, config, dtype=torch.float32))
    tensors = {name: tensor.clone() for name, tensor in stream}  # collective: every rank iterates
    if not stream.is_source:
        assert not tensors, "a non-source rank received tensors"
        return None
    return StreamedCase(megatron, tensors, hf_logits_from_checkpoint(tensors.items(), config, tokens))
