"""The bottom layer: data and rules every other part of megatron_sync builds on; it imports nothing above it."""
