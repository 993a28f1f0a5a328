"""The callback's cadence (optimizer updates, not iterations) and the config switches it honours."""

import json

import pytest

from megatron_sync.drivers.callback import WeightSyncCallback
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.drivers.sync import build_converter


class _CountingSyncer:
    def __init__(self):
        self.versions = []

    def sync(self):
        self.versions.append(len(self.versions) + 1)
        return self.versions[-1]


def test_syncs_on_every_nth_successful_update_only():
    syncer = _CountingSyncer()
    callback = WeightSyncCallback(syncer, [], every_n_steps=3)
    outcomes = [callback.after_optimizer_step(ok) for ok in (True, True, False, True, True, True, True)]
    # The skipped update (loss-scale overflow) does not count: syncs after the 3rd and 6th real updates.
    assert outcomes == [None, None, None, 1, None, None, 2]


def test_disabled_config_never_connects():
    config = WeightSyncConfig(enabled=False, every_n_steps=1)
    callback = WeightSyncCallback.from_config(config, [])
    assert [callback.after_optimizer_step() for _ in range(3)] == [None, None, None]
    assert callback.updates == 3


def test_converter_needs_an_hf_config(tmp_path):
    with pytest.raises(ValueError, match="hf_config_path"):
        build_converter(WeightSyncConfig(family="qwen3"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 250,
        "tie_word_embeddings": False,
    }))
    converter = build_converter(WeightSyncConfig(family="qwen3", hf_config_path=str(path), dtype="float32"))
    assert "model.layers.1.self_attn.q_norm.weight" in converter.expected_hf_tensors()
