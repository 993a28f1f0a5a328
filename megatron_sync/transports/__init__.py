"""Transports by name: `weight_sync.transport` picks one from this registry.

A new transport is one module implementing `Transport` (or `BucketTransport`)
plus one line here, or a `register_transport` call (tests register toys).
Entries are import paths so that reading the registry imports no transport.
"""

from __future__ import annotations

from importlib import import_module
from typing import Optional, Union

from megatron_sync.settings import registry as settings_registry

_REGISTRY: dict[str, Union[str, type]] = {
    "broadcast": "megatron_sync.transports.broadcast:BroadcastTransport",
    "p2p": "megatron_sync.transports.p2p.transport:P2PTransport",
    "sglang": "megatron_sync.transports.sglang:SGLangTransport",
    "disk_delta": "megatron_sync.transports.disk_delta.transport:DiskDeltaTransport",
    "ipc": "megatron_sync.transports.ipc.transport:IpcTransport",
}


_SETTINGS_CHECKS: dict[str, str] = {
    "disk_delta": "megatron_sync.transports.disk_delta.options:writer_options",
    "ipc": "megatron_sync.transports.ipc.options:check_settings",
    "auto": "megatron_sync.scale.auto:check_settings",  # the scale model chooses among the transports
}
for _name in [*_REGISTRY, "auto"]:
    settings_registry.register(_name, _SETTINGS_CHECKS.get(_name))


def transport_names() -> list[str]:
    """Return the names of the implemented transports."""
    return sorted(_REGISTRY)


# What the drivers call on a transport class (`megatron_sync.transports.base.Transport`); checked by name so
# that this registry, which configuration reads, imports no transport.
_INTERFACE = ("meets_at_store", "trainer_joins", "connect_trainer", "connect_inference", "make_sender", "make_receiver")


def register_transport(name: str, cls: type, check: Optional[str] = None) -> None:
    """Make `cls` (a `Transport` subclass) available as `transport: name` (`check`: "module:function"
    validating its settings, see `megatron_sync.settings.registry`)."""
    if not (isinstance(cls, type) and all(hasattr(cls, attr) for attr in _INTERFACE)):
        raise TypeError(f"register_transport({name!r}, ...) needs a Transport subclass, got {cls!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"transport {name!r} is registered already ({existing!r}); register {cls.__name__} "
                         "under another name")
    _REGISTRY[name] = cls
    settings_registry.register(name, check)


def get_transport(name: str) -> type:
    """Return the Transport class registered as `name`; ValueError lists the implemented ones."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"transport={name!r} is not implemented; use one of {transport_names()}") from None
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = _REGISTRY[name] = getattr(import_module(module), attr)
    return entry
