"""Where the reference engine's weights live in transformers' model: the slot of each checkpoint tensor (its own
parameter, or a part of a fused one: transformers 5 keeps experts fused in memory), allocating a model built on
the meta device, and the HF checkpoint tensors of a whole transformers model (`engines/reference/engine.py`).
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from megatron_sync.convert.patterns import compile_pattern

# transformers 5's in-memory home of per-expert checkpoint tensors: (checkpoint pattern, fused tensor, part).
_EXPERTS = "model.layers.{layer}.mlp.experts."
FUSED_EXPERTS = (
    (_EXPERTS + "{expert}.gate_proj.weight", _EXPERTS + "gate_up_proj", "gate"),
    (_EXPERTS + "{expert}.up_proj.weight", _EXPERTS + "gate_up_proj", "up"),
    (_EXPERTS + "{expert}.down_proj.weight", _EXPERTS + "down_proj", "down"),
)


@dataclass(frozen=True)
class _Slot:
    """Where a checkpoint tensor lives in memory: a named tensor, optionally one expert's part of it."""

    memory_name: str
    expert: int | None = None
    part: str | None = None

    def view(self, live: torch.Tensor) -> torch.Tensor:
        """Return the region of the live in-memory tensor that holds this checkpoint tensor."""
        if self.part is None:
            return live
        if self.part == "down":
            return live[self.expert]
        half = live.shape[1] // 2
        return live[self.expert, :half] if self.part == "gate" else live[self.expert, half:]


def _slot_of(name: str, memory: dict[str, torch.Tensor]) -> _Slot | None:
    """Return where checkpoint tensor `name` lives among the model's in-memory tensors (None: nowhere)."""
    if name in memory:
        return _Slot(name)
    for checkpoint, fused, part in FUSED_EXPERTS:
        captures = compile_pattern(checkpoint).match(name)
        if captures is not None:
            memory_name = compile_pattern(fused).format(**captures)
            if memory_name in memory:
                return _Slot(memory_name, captures["expert"], part)
    return None


def _live_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """Return the parameter or buffer called `name`."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _set_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Give the parameter or buffer `name` the dtype `dtype` (on the meta device: no data moves)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    tensor = getattr(module, attr)
    if tensor.dtype == dtype:
        return
    if isinstance(tensor, nn.Parameter):
        setattr(module, attr, nn.Parameter(tensor.to(dtype), requires_grad=False))
    else:
        module.register_buffer(attr, tensor.to(dtype), persistent=True)  # expected tensors are checkpointed


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
