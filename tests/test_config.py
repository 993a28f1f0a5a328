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
    ({"staging_sets": 3}, r"staging_sets=3: use \"auto\" .*, 2 .* or 1"),
    ({"staging_sets": "two"}, r"staging_sets='two': use \"auto\""),
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
    # a setting that is a number or a word: "1" on the command line is the number 1, as in YAML
    for given, meant in (("1", 1), ("2", 2), ("auto", "auto")):
        cfg = WeightSyncConfig.from_args(parser.parse_args(["--weight-sync-staging-sets", given]))
        assert cfg.staging_sets == meant and type(cfg.staging_sets) is type(meant)


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


def _yaml(tmp_path, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return str(path)


def test_transport_settings_live_in_their_section(tmp_path):
    cfg = WeightSyncConfig.from_yaml(_yaml(tmp_path, """
weight_sync:
  transport: p2p
  p2p: {backend: nixl, arena_mb: 64, forward: false, nixl_wake_ms: 2}
  fleet: {enabled: true, min_engines: 1, wave_size: 2}
"""))
    assert (cfg.p2p_backend, cfg.p2p_arena_mb, cfg.p2p_forward, cfg.p2p_nixl_wake_ms) == ("nixl", 64, False, 2)
    with pytest.raises(ValueError, match=r"p2p_nixl_wake_ms must be a number of milliseconds >= 0"):
        WeightSyncConfig.from_dict({"transport": "p2p", "p2p": {"backend": "nixl", "nixl_wake_ms": -1}})
    assert (cfg.fleet, cfg.wave_size) == (True, 2)
    delta = WeightSyncConfig.from_dict({"transport": "disk_delta", "family": "qwen3",
                                        "disk_delta": {"dir": str(tmp_path), "local_dir": str(tmp_path / "l")}})
    assert delta.delta_dir == str(tmp_path)
    with pytest.raises(ValueError, match=r"unknown keys \['bakend'\] in weight_sync.p2p; valid keys are \['backend'"):
        WeightSyncConfig.from_dict({"transport": "p2p", "p2p": {"bakend": "nixl"}})


def test_the_flat_spelling_of_the_last_release_works_with_a_deprecation_line():
    with pytest.warns(DeprecationWarning, match=r"weight_sync.p2p_backend is deprecated .* write p2p.backend"):
        cfg = WeightSyncConfig.from_dict({"transport": "p2p", "p2p_backend": "mooncake"})
    assert cfg.p2p_backend == "mooncake"
    with pytest.warns(DeprecationWarning, match=r"weight_sync.fleet is deprecated .* write fleet.enabled"):
        assert WeightSyncConfig.from_dict({"fleet": True}).fleet
    with pytest.raises(ValueError, match="p2p.backend is given twice"):
        WeightSyncConfig.from_dict({"transport": "p2p", "p2p_backend": "torch", "p2p": {"backend": "nixl"}})
    parser = add_weight_sync_args(argparse.ArgumentParser())
    with pytest.warns(DeprecationWarning, match="--weight-sync-delta-retention is deprecated .* use "
                                                "--weight-sync-disk-delta-retention"):
        ns = parser.parse_args(["--weight-sync-transport", "disk_delta", "--weight-sync-disk-delta-dir", "/s",
                                "--weight-sync-disk-delta-local-dir", "/l", "--weight-sync-delta-retention", "7"])
    assert WeightSyncConfig.from_args(ns).delta_retention == 7
    with pytest.warns(DeprecationWarning, match="--no-weight-sync-relay is deprecated"):
        parser.parse_args(["--no-weight-sync-relay"])
    ns = parser.parse_args(["--weight-sync-fleet", "--weight-sync-fleet-wave-size", "2", "--no-weight-sync-fleet-relay"])
    assert (ns.weight_sync_fleet, ns.weight_sync_wave_size, ns.weight_sync_relay) == (True, 2, False)


@pytest.mark.parametrize("values,match", [
    ({"p2p": {"backend": "nixl"}}, r"p2p.backend does nothing here: it is read with transport p2p, and this job "
                                   r"uses transport 'broadcast'; remove it, or set transport: p2p"),
    ({"transport": "p2p", "disk_delta": {}}, r"the 'disk_delta:' section does nothing here"),
    ({"fleet": {"wave_size": 2}}, r"fleet.wave_size does nothing here: .* is not a fleet .* set fleet.enabled: true"),
    ({"fleet": {"relay": True}}, r"fleet.relay does nothing here"),
    ({"hardware_profile": "h100"}, r"hardware_profile='h100' is read by transport 'auto' only"),
])
def test_a_setting_that_does_nothing_for_the_chosen_transport_is_refused(values, match):
    with pytest.raises(ValueError, match=match):
        WeightSyncConfig.from_dict(values)


def test_settings_of_the_transport_auto_may_choose_are_accepted():
    cfg = WeightSyncConfig.from_dict({"transport": "auto", "hardware_profile": "local", "p2p": {"backend": "nixl"}})
    assert cfg.p2p_backend == "nixl"


def test_ipc_over_nccl_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ipc over nccl is valid here")
    with pytest.raises(ValueError, match="transport 'ipc' with backend 'nccl' .* no CUDA device; use backend 'auto'"):
        WeightSyncConfig(transport="ipc", backend="nccl")
    assert WeightSyncConfig(transport="ipc").backend == "auto"


@pytest.mark.parametrize("fleet,match", [
    ({"enabled": True, "relay": True}, r"a fleet of SGLang servers is fed by the trainer in one wave .* drop "
                                       r"fleet.relay"),
    ({"enabled": True, "wave_size": 1}, r"drop fleet.relay, fleet.wave_size and fleet.max_staleness"),
])
def test_a_fleet_of_sglang_servers_refuses_waves_and_relays(fleet, match):
    engines = {"transport": "sglang", "engines": ["sglang=http://127.0.0.1:1"]}
    assert WeightSyncConfig.from_dict({**engines, "fleet": {"enabled": True, "min_engines": 1}}).fleet
    with pytest.raises(ValueError, match=match):
        WeightSyncConfig.from_dict({**engines, "fleet": fleet})
    with pytest.raises(ValueError, match=r"transport 'disk_delta' is not elastic yet"):
        WeightSyncConfig.from_dict({"transport": "disk_delta", "delta_dir": "/d", "fleet": {"enabled": True}})
