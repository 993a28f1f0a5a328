"""A tiny, anchored name-pattern grammar shared by Megatron and HF names.

A pattern is a literal parameter name in which `{layer}` and `{expert}` stand
for decimal indices. It compiles once to a regex that must match the *whole*
name, so `decoder.layers.{layer}.x` never matches inside a longer name and
`layers.1` never matches `layers.11`. The same object formats a name from
captures, which makes every pattern usable in both directions.
"""

from __future__ import annotations

import re
from functools import lru_cache

WILDCARDS = ("layer", "expert")
_FIELD = re.compile(r"\{(\w+)\}")


class Pattern:
    """One compiled name pattern: `match` a name into captures, `format` captures into a name."""

    __slots__ = ("template", "fields", "_regex")

    def __init__(self, template: str):
        parts, fields = [], []
        pos = 0
        for m in _FIELD.finditer(template):
            field = m.group(1)
            if field not in WILDCARDS:
                raise ValueError(
                    f"pattern {template!r} uses unknown wildcard {{{field}}}; "
                    f"only {', '.join('{' + w + '}' for w in WILDCARDS)} are allowed"
                )
            if field in fields:
                raise ValueError(f"pattern {template!r} uses {{{field}}} twice")
            parts.append(re.escape(template[pos:m.start()]))
            parts.append(rf"(?P<{field}>0|[1-9][0-9]*)")
            fields.append(field)
            pos = m.end()
        parts.append(re.escape(template[pos:]))
        self.template = template
        self.fields = tuple(fields)
        self._regex = re.compile("".join(parts))

    def match(self, name: str) -> dict[str, int] | None:
        """Return the captured indices if `name` matches the whole pattern, else None."""
        m = self._regex.fullmatch(name)
        if m is None:
            return None
        return {k: int(v) for k, v in m.groupdict().items()}

    def format(self, **captures: int) -> str:
        """Return the name this pattern gives for `captures` (extra captures are ignored)."""
        missing = [f for f in self.fields if f not in captures]
        if missing:
            raise ValueError(f"pattern {self.template!r} needs {missing} to format a name")
        return self.template.format(**{f: int(captures[f]) for f in self.fields})

    def __repr__(self) -> str:
        return f"Pattern({self.template!r})"


@lru_cache(maxsize=None)
def compile_pattern(template: str) -> Pattern:
    """Return the compiled `Pattern` for `template` (cached: each template compiles once)."""
    return Pattern(template)


def translate(name: str, source: str, target: str) -> str | None:
    """Return `name` rewritten from pattern `source` to pattern `target`, or None if it does not match."""
    captures = compile_pattern(source).match(name)
    if captures is None:
        return None
    return compile_pattern(target).format(**captures)
