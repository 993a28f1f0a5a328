"""The settings reference cannot drift: every field has a docstring, a type and a default, and the page lists them.

The page itself is built by `make docs` (MkDocs in strict mode, through the hook in `docs/hooks/`); these
tests run the same generator in-process, with a negative control for its check, and keep `FIELD_CHOICES`
(what the page lists as allowed values) in step with what validation refuses.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from megatron_sync.settings.config import FIELD_CHOICES, WeightSyncConfig, field_names

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("settings_page", ROOT / "docs" / "hooks" / "settings_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_every_settings_field_has_a_docstring_a_type_and_a_default():
    fields = gen.parse_fields(gen.CONFIG.read_text())
    assert [f.name for f in fields] == list(field_names())  # the parser sees exactly the dataclass's fields
    assert gen.problems(fields) == []


BUILT_IN_TRANSPORTS = ("broadcast", "disk_delta", "ipc", "p2p", "sglang", "auto")


def test_the_page_lists_every_field_with_its_docstring_default_and_allowed_values():
    fields = gen.parse_fields(gen.CONFIG.read_text())
    spellings = gen.load_spellings()
    page = gen.render(fields, gen.load_choices(), spellings)
    for f in fields:
        shown = spellings[f.name][0]
        assert f"### `{shown}` {{#{shown.replace('.', '-')}}}" in page, f.name
        assert f"| `{f.type}` | `{f.default}` |" in page, f.name
        assert gen._escape(f.doc) in page, f.name
    # choices from the registry, sorted, "auto" last (another test of this process may have registered more)
    listed = re.search(r"`broadcast`(, `\w+`)*, `auto`", page)
    assert listed, "the transport's choices are not on the page"
    names = re.findall(r"`(\w+)`", listed.group(0))
    assert [n for n in names if n in BUILT_IN_TRANSPORTS] == list(BUILT_IN_TRANSPORTS) and names[-1] == "auto"
    assert "### `p2p.backend` {#p2p-backend}" in page  # a transport's settings as its section writes them
    assert "| `str` | `\"torch\"` | `nixl`, `mooncake`, `torch` | `--weight-sync-p2p-backend` |" in page
    assert "`--weight-sync-disk-delta-dir` (was `--weight-sync-delta-dir`)" in page
    assert "| `Optional[str]` | `null` | a string, or `null` |" in page


NO_DOCSTRING = '''
from dataclasses import dataclass
from typing import Optional

@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """Settings."""

    documented: int = 1
    """Has one."""

    forgotten: float = 2.0

    required: Optional[str]
    """No default."""
'''


def test_a_field_without_a_docstring_or_default_is_reported_by_name():
    fields = gen.parse_fields(NO_DOCSTRING)
    found = gen.problems(fields)
    assert len(found) == 2, found
    assert "field 'forgotten' (line 12) has no docstring" in found[0]
    assert "field 'required' (line 14) has no default" in found[1]


def test_the_build_fails_on_an_undocumented_field(tmp_path):
    source = tmp_path / "config.py"
    source.write_text(NO_DOCSTRING)
    with pytest.raises(ValueError, match="forgotten"):
        gen.build_page(source, choices_loader=lambda: {}, spellings_loader=lambda: {})


NESTED = '''
from dataclasses import dataclass, field
from typing import Optional

LIMIT = 64.0

@dataclass(frozen=True, kw_only=True)
class P2PSettings:
    """The p2p section."""

    backend: str = "torch"
    """What moves the bytes."""

    arena_mb: float = LIMIT
    """Arena size."""

@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """Settings."""

    transport: str = "p2p"
    """How bytes move."""

    p2p: P2PSettings = field(default_factory=P2PSettings)
    """Settings of transport p2p."""
'''


def test_a_nested_settings_section_is_expanded_with_dotted_names():
    fields = gen.parse_fields(NESTED)
    assert [(f.name, f.default, f.section) for f in fields] == [
        ("transport", '"p2p"', None), ("p2p", "P2PSettings()", "P2PSettings"),
        ("p2p.backend", '"torch"', None), ("p2p.arena_mb", "64.0", None)]
    assert gen.problems(fields) == []
    page = gen.render(fields, {"p2p.backend": ["torch", "nixl"]})
    assert "### `p2p.arena_mb` {#p2p-arena_mb}" in page
    assert "| `str` | `\"torch\"` | `torch`, `nixl` | YAML only |" in page


def _validated_choices() -> set[str]:
    """Return the fields the settings' checks (megatron_sync/settings/checks.py) test with `check_choice`."""
    tree = ast.parse((gen.CONFIG.parent / "checks.py").read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_choice"
            and node.args and isinstance(node.args[0], ast.Constant)}


def test_every_field_validated_against_a_set_of_values_lists_them_in_field_choices():
    missing = _validated_choices() - set(FIELD_CHOICES)
    assert not missing, (f"{sorted(missing)} are validated with check_choice but missing from FIELD_CHOICES in "
                         "megatron_sync/settings/choices.py: add them there, so the settings reference lists them")


@pytest.mark.parametrize("name", sorted(FIELD_CHOICES))
def test_validation_refuses_what_field_choices_does_not_list(name):
    choices = gen.load_choices()[name]
    with pytest.raises(ValueError) as refused:
        WeightSyncConfig(**{name: "not-a-choice"})
    listed = re.findall(r"'([^']+)'", str(refused.value).split("use one of", 1)[-1])
    assert listed == choices, (name, str(refused.value))


README_LIMIT = 12 * 1024
"""The README introduces (what, install, the ten lines, the demo, vLLM, which transport); the docs explain."""


def test_the_readme_stays_short_and_its_links_into_the_docs_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, (f"README.md is {len(text.encode())} bytes, over {README_LIMIT}: "
                                                "move the detail into a page under docs/ and link it")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
