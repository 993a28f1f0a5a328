"""megatron-sync: move freshly trained Megatron weights into inference engines during RL post-training."""

import megatron_sync.transports  # noqa: F401  fills the settings' registry of transport names (imports no transport)
