"""Errors raised while mapping Megatron tensors to the HF checkpoint format.

Every message names the tensor involved and says how to fix the mismatch.
"""

from __future__ import annotations


class ConversionError(ValueError):
    """Base class: a Megatron tensor cannot be turned into the HF checkpoint format."""


class UnknownFamilyError(ConversionError):
    """`get_converter` was asked for a model family it does not know."""


class ConfigError(ConversionError):
    """The HF config lacks a value a rule needs, or asks for a variant the family does not support."""


class UnmappedParameterError(ConversionError):
    """A Megatron name matches no rule and is not in the skip list."""


class MissingTensorError(ConversionError):
    """An HF tensor the config requires was never produced."""


class UnexpectedTensorError(ConversionError):
    """An HF tensor was produced that the config does not call for (or was produced twice)."""


class ShapeMismatchError(ConversionError):
    """A tensor's shape contradicts the HF config."""
