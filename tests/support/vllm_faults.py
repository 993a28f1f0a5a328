"""Test-only vLLM plugin: makes one worker's load of one version fail halfway or leave one parameter changed,
and reads back a draft's weights.

The vLLM tests register it next to the real plugin (tests/support/real_engines.plugin_path).

- Faults, armed through a file: with MEGATRON_SYNC_TEST_FAULTS=<file>, writing
  {"version": v, "worker": w} into the file makes worker w's load of version v
  raise after vLLM consumed half of the tensors, so the real restore path runs;
  with "part": "draft" the load fails halfway through the speculative draft's
  params instead, after the target's were loaded; {"version": v, "worker": w,
  "corrupt": name} lets the load succeed, then flips one byte of vLLM's
  parameter `name` (a fault no wire checksum sees: the post-load check must).
- A generation held for the sync, armed through the same file: {"hold_after_tokens": n, "id": any} makes
  the engine core, once a running request has n output tokens, stop stepping until the next client
  request (the sync's /pause) reaches it, once per id, and writes <file>.held (the id) when it held. A sync
  then lands inside the generation by construction, however fast the model decodes or slowly the trainer
  starts its sync.
- Draft read-back: with MEGATRON_SYNC_TEST_DRAFT_DUMP=<folder>, after every load
  (committed or restored) each worker with an MTP draft writes what its draft
  model holds to <folder>/worker<w>.pt: the version, every parameter of the
  draft's own layers as vLLM computes with it (read back: a CPU linear layer
  whose weight vLLM packed for its GEMM is read through that GEMM on the
  identity), and the draft's recorded layout, so the test rebuilds the
  checkpoint tensors those parameters must hold.
"""

from __future__ import annotations

import json
import os
import queue

_DRAFT_FAULT: list = [None]  # the message of an armed draft fault, for the load under way


def register() -> None:
    """Wrap VLLMModelAdapter.load_shards (and the draft's load) in this process when configured."""
    faults, dump = os.environ.get("MEGATRON_SYNC_TEST_FAULTS"), os.environ.get("MEGATRON_SYNC_TEST_DRAFT_DUMP")
    if not faults and not dump:
        return
    if faults:
        _hold_generations_for_a_pause(faults)
    from megatron_sync.engines.vllm import adapter, draft

    original = adapter.VLLMModelAdapter.load_shards
    if getattr(original, "_fault_wrapped", False):
        return

    def load_shards(self, shards, version):
        fault = (_armed(faults) if faults else None) or {}
        ours = (fault.get("version"), fault.get("worker")) == (version, self.worker_rank)
        corrupt = fault.get("corrupt") if ours else None
        if ours and corrupt is None:
            message = f"injected load failure on worker {self.worker_rank} at version {version}"
            if fault.get("part") == "draft":
                _DRAFT_FAULT[0] = message + " (draft)"
            else:
                shards = _FailingHalfway(shards, message)
        try:
            loaded = original(self, shards, version)
            if corrupt is not None:
                import torch

                with torch.no_grad():
                    self.model.get_parameter(corrupt).data.view(-1).view(torch.uint8)[0] ^= 0x01
            return loaded
        finally:
            _DRAFT_FAULT[0] = None
            if dump and self.draft is not None:
                _dump_draft(self, dump)

    original_draft_load = draft.DraftModel.load

    def draft_load(self, target, params):
        message, _DRAFT_FAULT[0] = _DRAFT_FAULT[0], None  # once: the restore that follows loads as usual
        return original_draft_load(self, target, params if message is None else _FailingHalfway(params, message))

    load_shards._fault_wrapped = True
    adapter.VLLMModelAdapter.load_shards = load_shards
    draft.DraftModel.load = draft_load


HOLD_S = 300.0  # the longest a held generation waits for the pause: a test that never sends one fails, not hangs


def _hold_generations_for_a_pause(faults: str) -> None:
    """Wrap the engine core's step (in the engine-core process) with the armed hold described above."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:  # not a vLLM with a separate engine-core process: the hold fails its test by name
        return
    original = EngineCoreProc._process_engine_step
    if getattr(original, "_fault_wrapped", False):
        return
    released: set = set()

    def _process_engine_step(self):
        fault = _armed(faults) or {}
        after, hold_id = fault.get("hold_after_tokens"), fault.get("id")
        if after is None or hold_id in released:
            return original(self)
        if not any(r.num_output_tokens >= after for r in self.scheduler.running):
            return original(self)
        released.add(hold_id)
        with open(faults + ".held", "w") as f:
            f.write(str(hold_id))
        try:
            request = self.input_queue.get(timeout=HOLD_S)  # the sync's /pause (nothing else runs in the test)
        except queue.Empty:
            raise RuntimeError(f"test hold {hold_id}: no client request reached the engine core within {HOLD_S} s")
        self._handle_client_request(*request)
        return False  # the busy loop decides what runs next, as after any client request

    _process_engine_step._fault_wrapped = True
    EngineCoreProc._process_engine_step = _process_engine_step


def _armed(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class _FailingHalfway:
    """Yields the first half of the tensors, then raises (vLLM has processed some layers by then). Carries what
    the receiver handed with them: with one staging set, the host copy of the version before (`previous`)."""

    def __init__(self, shards, message: str) -> None:
        self._shards, self._message = shards, message
        self.previous = getattr(shards, "previous", None)

    def items(self):
        items = list(self._shards.items())
        yield from items[: len(items) // 2]
        raise RuntimeError(self._message)


def _dump_draft(adapter, folder: str) -> None:
    """Write what `adapter`'s draft model holds now (see the module doc)."""
    import torch

    from megatron_sync.engines.vllm.draft import owned_only

    held = {}
    with owned_only(adapter.draft.model, adapter.model), torch.no_grad():
        for name, param in adapter.draft.model.named_parameters():
            layer = adapter.draft.model.get_submodule(name.rpartition(".")[0])
            packing = _cpu_moe_packing(layer) if name.endswith(("w13_weight", "w2_weight")) else None
            if param.numel() == 0 and hasattr(layer, "cpu_linear"):  # packed for vLLM's CPU GEMM
                inputs = getattr(layer, "input_size_per_partition", layer.input_size)  # a replicated one: all
                eye = torch.eye(inputs, dtype=layer.params_dtype)
                held[name] = {"through_gemm": layer.cpu_linear(eye, None, None).t().contiguous()}
            elif packing is not None:  # experts vLLM prepacked for its CPU kernel: unpacked by its own packing
                held[name] = {"unpacked": _unpacked(param.detach(), packing)}
            else:
                held[name] = {"tensor": param.detach().clone()}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"worker{adapter.worker_rank}.pt")
    torch.save({"version": adapter.version, "params": held, "layout": adapter.draft.layout.to_wire()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _cpu_moe_packing(layer):
    """Return the ISA vLLM's CPU MoE kernel prepacked `layer`'s expert weights for (None: not prepacked)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts.isa if isinstance(experts, CPUUnquantizedExperts) else None


def _unpacked(packed, isa: str):
    """Return `packed` (vLLM's CPU MoE prepack of a weight) in the weight's own layout: the prepack only moves
    elements, so packing the element indices (exact in fp32 below 2**24) says where each one went."""
    import torch
    from vllm import _custom_ops as ops

    assert packed.dtype == torch.float32 and packed.numel() < 2**24, (packed.dtype, packed.numel())
    moved = ops.cpu_prepack_moe_weight(torch.arange(packed.numel(), dtype=torch.float32).view(packed.shape), isa)
    source = moved.flatten().long()
    assert torch.equal(source.sort().values, torch.arange(packed.numel())), "the prepack is not a permutation"
    unpacked = torch.empty_like(packed).flatten()
    unpacked[source] = packed.flatten()
    return unpacked.view(packed.shape)
