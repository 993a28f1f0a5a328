"""Loaded by every Python process of an SGLang server started with this folder on PYTHONPATH (test support).

PyPI's only torchvision 0.28.0 is a CUDA build: its compiled operators do not
load beside the CPU torch, and its Python side then fails registering fake
kernels for `torchvision::nms` / `torchvision::qnms`. SGLang imports
`torchvision.transforms` unconditionally (multimodal helpers), so the two
schemas are declared here first; text models never call them.
"""

try:
    import torch

    _TORCHVISION = torch.library.Library("torchvision", "FRAGMENT")
    _TORCHVISION.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except (ImportError, RuntimeError) as error:  # no torch in this interpreter, or a real torchvision already did it
    import sys

    sys.stderr.write(f"[sglang shim] torchvision schemas not declared: {error}\n")
