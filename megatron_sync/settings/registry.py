"""What the settings know of the transports: their names, and the check each runs on its own settings.

Filled from above: `megatron_sync.transports` registers every built-in transport here when the package is
imported (`megatron_sync/__init__.py` imports it first), and `register_transport` adds one a user or a test
brings. A check is an import path ("module:function") called with the whole settings object when that
transport is chosen, so reading the settings imports no transport.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Optional

_CHECKS: dict[str, Optional[str]] = {}


def register(name: str, check: Optional[str] = None) -> None:
    """Make `name` a known `transport` setting; `check` ("module:function") validates its settings. A name
    registered already with another check is refused: two transports must not share a name."""
    if name in _CHECKS and _CHECKS[name] != check:
        raise ValueError(f"transport {name!r} is registered already (with check {_CHECKS[name]!r}); "
                         "register yours under another name")
    _CHECKS[name] = check


def names() -> list[str]:
    """Return the registered transport names, sorted, with "auto" (a choice among them) last."""
    return sorted(n for n in _CHECKS if n != "auto") + (["auto"] if "auto" in _CHECKS else [])


def check(settings: Any) -> None:
    """Run the check of the chosen transport on `settings` (ValueError names the field and the fix)."""
    path = _CHECKS.get(settings.transport)
    if path is not None:
        module, function = path.split(":")
        getattr(import_module(module), function)(settings)
