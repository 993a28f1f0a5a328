"""WeightSyncConfig: validation, YAML section, argparse flags."""

from __future__ import annotations

import argparse

import pytest

from megatron_sync.settings.config import WeightSyncConfig, add_weight_sync_args, field_names


def test_defaults_are_valid_and_keyword_only():
    cfg = WeightSyncConfig()
    assert cfg.transport == "broadcast" and cfg.bucket_size_bytes == 512 * 2**20
    with pytest.raises(TypeError):
        WeightSyncConfig(True)  # positional arguments are refused


@pytest.mark.parametrize("kwargs,match", [
    ({"every_n_steps": 0}, "every_n_steps"),
    ({"transport": "carrier_pigeon"}, r"transport='carrier_pigeon' is not valid; use one of \['broadcast'"),
    ({"backend": "mpi"}, "backend"),
    ({"master_port": 70000}, "master_port"),
    ({"master_address": ""}, "master_address"),
    ({"num_inference_ranks": 3, "engine_tp_size": 2}, "engine_tp_size=2 must divide"),
    ({"bucket_size_mb": 0}, "bucket_size_mb"),
    ({"bucket_size_mb": -1.5}, "bucket_size_mb"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"dtype": "bf16"}, "dtype"),
    ({"inflight_policy": "pause"}, "inflight_policy"),
    ({"enabled": "yes"}, "enabled"),
    ({"every_n_steps": 1.5}, "every_n_steps"),
    ({"checksum": "md5"}, r"checksum='md5' is not valid; use one of \['auto', 'xxh3', 'crc32', 'wsum64', 'none'\]"),
])
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSyncConfig(**kwargs)


def test_frozen():
    with pytest.raises(Exception):
        WeightSyncConfig().bucket_size_mb = 1.0


def test_from_yaml_reads_the_weight_sync_section(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "model: {layers: 2}\n"
        "weight_sync:\n  every_n_steps: 4\n  bucket_size_mb: 0.5\n  backend: gloo\n"
        "  metrics_path: /tmp/m.jsonl\n"
    )
    cfg = WeightSyncConfig.from_yaml(str(path))
    assert (cfg.every_n_steps, cfg.bucket_size_mb, cfg.backend) == (4, 0.5, "gloo")
    assert cfg.bucket_size_bytes == 512 * 1024


def test_from_yaml_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("weight_sync:\n  bucket_mb: 4\n")
    with pytest.raises(ValueError, match=r"unknown weight_sync keys \['bucket_mb'\].*bucket_size_mb"):
        WeightSyncConfig.from_yaml(str(path))


def test_from_yaml_missing_section(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: {}\n")
    with pytest.raises(ValueError, match="weight_sync"):
        WeightSyncConfig.from_yaml(str(path))


def test_argparse_flags_round_trip():
    parser = add_weight_sync_args(argparse.ArgumentParser())
    assert isinstance(parser, argparse.ArgumentParser)
    ns = parser.parse_args([
        "--weight-sync-every-n-steps", "2", "--weight-sync-bucket-size-mb", "64",
        "--no-weight-sync-enabled", "--weight-sync-master-port", "31000",
        "--weight-sync-hf-config-path", "/models/qwen/config.json",
    ])
    cfg = WeightSyncConfig.from_args(ns)
    assert (cfg.every_n_steps, cfg.bucket_size_mb, cfg.enabled, cfg.master_port) == (2, 64.0, False, 31000)
    assert cfg.hf_config_path == "/models/qwen/config.json"
    assert WeightSyncConfig.from_args(parser.parse_args([])) == WeightSyncConfig()


def test_argparse_bad_value_is_validated():
    parser = add_weight_sync_args(argparse.ArgumentParser())
    with pytest.raises(ValueError, match="backend"):
        WeightSyncConfig.from_args(parser.parse_args(["--weight-sync-backend", "mpi"]))


def test_every_field_has_a_flag():
    parser = add_weight_sync_args(argparse.ArgumentParser())
    ns = parser.parse_args([])
    assert all(hasattr(ns, f"weight_sync_{name}") for name in field_names())


def test_checksum_choices_are_the_bucket_module_table_plus_auto():
    from megatron_sync.core.checksum import CHECKSUMS
    from megatron_sync.settings.config import CHECKSUM_CHOICES

    assert CHECKSUM_CHOICES == ("auto", *CHECKSUMS)
    assert WeightSyncConfig().checksum == "auto"
    assert WeightSyncConfig(checksum="none").checksum == "none"
