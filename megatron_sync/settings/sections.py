"""Settings that belong to one transport (or to the fleet) live in a section of their own.

In YAML a section is a mapping under `weight_sync:` (`p2p: {backend: nixl}`); on the command line its flags
carry the section's name (`--weight-sync-p2p-backend`). The settings object keeps one flat field per setting
(`p2p_backend`), so code reads `config.p2p_backend`; this module translates between the two spellings, keeps
the flat spellings of earlier releases working for one release with a deprecation line, and names a section
that does nothing for the chosen transport.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

SECTIONS: dict[str, dict[str, str]] = {
    "p2p": {
        "backend": "p2p_backend", "protocol": "p2p_protocol", "device_name": "p2p_device_name",
        "local_hostname": "p2p_local_hostname", "arena_mb": "p2p_arena_mb", "window_mb": "p2p_window_mb",
        "forward": "p2p_forward", "nixl_wake_ms": "p2p_nixl_wake_ms",
    },
    "disk_delta": {
        "dir": "delta_dir", "local_dir": "delta_local_dir", "snapshot_every": "delta_snapshot_every",
        "retention": "delta_retention", "encoding": "delta_encoding", "when_behind": "delta_when_behind",
        "queue_depth": "delta_queue_depth", "encode_threads": "delta_encode_threads",
    },
    "sglang": {"load": "sglang_load"},
    "fleet": {
        "enabled": "fleet", "engine_id": "engine_id", "min_engines": "min_engines", "wave_size": "wave_size",
        "relay": "relay", "max_staleness": "max_staleness",
    },
}
"""Section -> {key in the section: the settings field it sets}."""

OWNER: dict[str, str] = {"p2p": "transport p2p", "disk_delta": "transport disk_delta", "sglang": "transport sglang",
                         "fleet": "fleet.enabled"}
"""What makes each section do something."""

FIELD_SECTION: dict[str, tuple[str, str]] = {
    field: (section, key) for section, keys in SECTIONS.items() for key, field in keys.items()}
"""Settings field -> (its section, its key there)."""


def spelling(field: str) -> str:
    """Return how a user writes `field` in YAML: "p2p.backend", or the field's name for a shared setting."""
    section, key = FIELD_SECTION.get(field, (None, field))
    return f"{section}.{key}" if section else key


def flag(field: str) -> str:
    """Return the command-line flag of `field` ("--weight-sync-p2p-backend", "--weight-sync-fleet")."""
    section, key = FIELD_SECTION.get(field, (None, field))
    words = key if section is None else (section if key == "enabled" else f"{section}_{key}")
    return "--weight-sync-" + words.replace("_", "-")


def deprecated_flag(field: str) -> Optional[str]:
    """Return the flat flag of an earlier release for `field` when it differs from today's, else None."""
    old = "--weight-sync-" + field.replace("_", "-")
    return old if field in FIELD_SECTION and old != flag(field) else None


def sectioned(values: Mapping[str, Any], where: str = "weight_sync") -> dict[str, Any]:
    """Return `values` (a `weight_sync:` mapping) with its sections flattened into settings fields.

    A flat key of an earlier release (`p2p_backend`, `delta_dir`, `wave_size`, `fleet: true`) still works and
    logs one deprecation line naming the new spelling; an unknown key in a section is refused with the valid ones;
    a key given both ways is refused.
    """
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if name in SECTIONS and isinstance(value, Mapping):
            _flatten_section(name, value, flat, where)
        elif name in SECTIONS and value is None:
            continue  # an empty section: `p2p:` with nothing under it
        else:
            if name in FIELD_SECTION:
                warnings.warn(f"{where}.{name} is deprecated and will be removed in the next release; write "
                              f"{spelling(name)} (in a '{FIELD_SECTION[name][0]}:' section)", DeprecationWarning,
                              stacklevel=3)
            _put(flat, name, value, where)
    return flat


def _flatten_section(section: str, values: Mapping[str, Any], flat: dict[str, Any], where: str) -> None:
    keys = SECTIONS[section]
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise ValueError(f"unknown keys {unknown} in {where}.{section}; valid keys are {list(keys)}")
    for key, value in values.items():
        _put(flat, keys[key], value, where)


def _put(flat: dict[str, Any], field: str, value: Any, where: str) -> None:
    if field in flat:
        raise ValueError(f"{where}: {spelling(field)} is given twice (once in its section, once as the "
                         f"deprecated {field}); keep {spelling(field)}")
    flat[field] = value


def deprecated_keys(values: Mapping[str, Any]) -> list[str]:
    """Return the keys of a `weight_sync:` mapping written in a deprecated flat spelling."""
    return [name for name in values if name in FIELD_SECTION and not (name in SECTIONS and isinstance(
        values[name], Mapping))]


def present_sections(values: Mapping[str, Any]) -> list[str]:
    """Return the sections a `weight_sync:` mapping writes (as mappings, empty ones included)."""
    return [name for name in values if name in SECTIONS and (values[name] is None or isinstance(values[name], Mapping))]


def inert_section_problem(config: Any, written: tuple[str, ...] = ()) -> Optional[str]:
    """Return what is wrong when a section's setting does nothing for `config`'s transport, else None.

    A section's field set to something else than its default, or a section `written` in the YAML, for a
    transport that does not read it, is named with the fix. A job with transport "auto" (the trainer picks
    p2p, disk_delta, ...) and transports registered by users are not judged.
    """
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for section, keys in SECTIONS.items():
        if _section_active(config, section):
            continue
        changed = [key for key, field in keys.items() if key != "enabled" and getattr(config, field) != defaults[field]]
        if changed or section in written:
            what = (f"{section}.{changed[0]}" if changed else f"the '{section}:' section")
            return (f"{what} does nothing here: it is read with {OWNER[section]}, and this job "
                    f"{_why_inactive(config, section)}; remove it, or " + _fix(section))
    return None


def _section_active(config: Any, section: str) -> bool:
    if section == "fleet":
        return bool(config.fleet)
    return config.transport in (section, "auto") or config.transport not in _BUILT_IN


def _why_inactive(config: Any, section: str) -> str:
    return "is not a fleet (fleet.enabled is false)" if section == "fleet" else f"uses transport {config.transport!r}"


def _fix(section: str) -> str:
    return "set fleet.enabled: true" if section == "fleet" else f"set transport: {section}"


_BUILT_IN = ("broadcast", "p2p", "sglang", "disk_delta", "ipc")
"""The transports whose settings this module knows; a transport registered by a user reads what it likes."""


def resolved(config: Any, *, transport: str, **chosen: Any) -> Any:
    """Return `config` (transport "auto") with the `transport` (and bucket size) the scale model chose: the profile
    and the sections of the transports not chosen, which said what auto might pick, go back to their defaults."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    unused = {field: defaults[field] for section, keys in SECTIONS.items()
              if section not in ("fleet", transport) and transport in _BUILT_IN for field in keys.values()}
    return config.replace(**{**unused, "hardware_profile": None, "transport": transport, **chosen})
