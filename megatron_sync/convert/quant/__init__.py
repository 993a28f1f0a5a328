"""Quantize converted HF weights into the tensors inference engines load (FP8 blocks/tensor, INT4 groups).

    plan = QuantPlan.from_hf_config(hf_config["quantization_config"], expected_names, is_linear_weight)
    for hf_name, tensor in converter.convert(megatron_name, full_tensor):
        for name, t in plan.quantize(hf_name, tensor):   # weight + its scales, one call
            ...
    expected = plan.expected_layout(converter.expected_hf_tensors())

Formats, rounding conventions and error bounds: `fp8.py`, `int4.py`; which
weights are quantized: `config.py`. Everything here is pure: no process
groups, no I/O, any device.
"""

from megatron_sync.convert.quant.config import (
    DEFAULT_UNQUANTIZED, QuantConfig, QuantScheme, TargetGroup, parse_quantization_config, select_targets,
)
from megatron_sync.convert.quant.fp8 import Fp8Block, Fp8Tensor
from megatron_sync.convert.quant.int4 import Int4Group, pack_int4, unpack_int4
from megatron_sync.convert.quant.plan import (
    QuantPlan, dequantize, output_groups, part_specs, quantize, quantized_names, shard_quantized, slice_quantized,
)

__all__ = [
    "Fp8Block", "Fp8Tensor", "Int4Group", "QuantScheme", "QuantConfig", "TargetGroup", "QuantPlan",
    "DEFAULT_UNQUANTIZED", "parse_quantization_config", "select_targets", "quantized_names", "quantize",
    "dequantize", "slice_quantized", "part_specs", "shard_quantized", "output_groups", "pack_int4", "unpack_int4",
]
