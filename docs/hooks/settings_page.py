"""The settings reference page, generated from the settings' own source so it cannot drift.

`megatron_sync/settings/config.py` is parsed with `ast`: every annotated assignment in the body of a
dataclass is a field; its type is the annotation, its default the assigned value, and its documentation
the string literal right after it. A field whose type is another dataclass of the same module is a
nested section (`p2p:` with its own fields, written `p2p.backend` here). Fields are listed in
declaration order (`ClassVar`s are not fields). The allowed values of a field that takes one of a
fixed set come from the module's `FIELD_CHOICES` (the objects validation checks), read by importing
the module from this checkout.

Used two ways: as an MkDocs hook (`mkdocs.yml: hooks:`), which adds the page `reference/settings.md`
to the build and fails it when a field lacks a docstring, a type or a default; and by
`tests/test_docs.py`, which runs the same check (`problems`) in the suite.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "megatron_sync" / "settings" / "config.py"
CONFIG_MODULE = "megatron_sync.settings.config"
SETTINGS_CLASS = "WeightSyncConfig"
PAGE = "reference/settings.md"
FLAG_PREFIX = "--weight-sync-"


@dataclass(frozen=True)
class Field:
    """One setting as its source states it."""

    name: str  # dotted for a field of a nested section: "p2p.backend"
    type: str  # the annotation's source text
    default: Optional[str]  # the default as a reader writes it in YAML; None when the field has none
    doc: Optional[str]  # the cleaned docstring; None when the field has none
    line: int
    section: Optional[str] = None  # the nested dataclass it is, when it is a section
    flag: Optional[str] = None  # its command-line flag, when the settings say (`load_spellings`)
    old_flag: Optional[str] = None  # the flag of the previous release, still accepted with a deprecation line


def parse_fields(source: str, class_name: str = SETTINGS_CLASS) -> list[Field]:
    """Return every field of dataclass `class_name` in `source`, nested sections expanded, in order."""
    tree = ast.parse(source)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef) and _is_dataclass(node)}
    constants = _module_constants(tree)
    if class_name not in classes:
        raise ValueError(f"no dataclass {class_name!r} in the settings source")
    return _fields_of(classes[class_name], classes, constants, prefix="", seen=())


def problems(fields: Sequence[Field]) -> list[str]:
    """Return one sentence per field that the reference cannot document: no docstring, no type, no default."""
    out = []
    for f in fields:
        if f.section is not None:
            if not f.doc:
                out.append(f"section {f.name!r} (line {f.line}) has no docstring: add a string literal right "
                           "after its annotated assignment saying what the section configures")
            continue
        if not f.doc:
            out.append(f"field {f.name!r} (line {f.line}) has no docstring: add a string literal right after "
                       "its annotated assignment saying what it does, its unit and its effect")
        if not f.type:
            out.append(f"field {f.name!r} (line {f.line}) has no type annotation")
        if f.default is None:
            out.append(f"field {f.name!r} (line {f.line}) has no default: every setting needs one "
                       "(None where the value is required, with the docstring saying when)")
    return out


def load_choices(module: str = CONFIG_MODULE) -> dict[str, list[str]]:
    """Return the module's FIELD_CHOICES with every entry resolved to a list (imported from this checkout)."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    for name in [m for m in sys.modules if m == "megatron_sync" or m.startswith("megatron_sync.")]:
        origin = getattr(sys.modules[name], "__file__", None) or ""
        if origin and not origin.startswith(str(ROOT)):  # another checkout's package was imported first
            raise RuntimeError(f"{name} was imported from {origin}, not from {ROOT}: build the docs in a fresh "
                               "process of this checkout")
    importlib.import_module("megatron_sync")  # fills the transport registry the "transport" choices come from
    table = getattr(importlib.import_module(module), "FIELD_CHOICES", {})
    return {name: list(value() if callable(value) else value) for name, value in table.items()}


def load_spellings() -> dict[str, tuple[str, str, Optional[str]]]:
    """Return field -> (how YAML writes it: "p2p.backend", its flag, the previous release's flag or None), from
    megatron_sync.settings.sections (a transport's settings live in its section; the object keeps flat fields)."""
    load_choices()  # imports this checkout's package, refusing another's
    sections = importlib.import_module("megatron_sync.settings.sections")
    names = importlib.import_module(CONFIG_MODULE).field_names()
    return {n: (sections.spelling(n), sections.flag(n), sections.deprecated_flag(n)) for n in names}


def render(fields: Sequence[Field], choices: Mapping[str, Sequence[str]],
           spellings: Optional[Mapping[str, tuple[str, str, Optional[str]]]] = None) -> str:
    """Return the settings reference page (Markdown) for `fields`; `spellings` (`load_spellings`) shows each
    field as YAML writes it, with its flag."""
    spelled = {name: spelling[0] for name, spelling in (spellings or {}).items()}
    choices = {spelled.get(name, name): values for name, values in choices.items()}
    fields = [_spelled(f, (spellings or {}).get(f.name)) for f in fields]
    out = [
        "# Settings reference",
        "",
        "Every setting of the `weight_sync:` section, generated when the site is built from the settings' own",
        "source (`megatron_sync/settings/config.py`: each field's type, default and docstring, and the",
        "allowed values validation checks). A transport's own settings sit in its section (`p2p:`, `disk_delta:`,",
        "`fleet:`; written `p2p.backend` here and `p2p: {backend: nixl}` in YAML), and a section the chosen",
        "transport does not read is refused. Set them in the `weight_sync:` section of the training YAML",
        "(`WeightSyncConfig.from_yaml`), as `--weight-sync-*` flags (`add_weight_sync_args`; a flag given",
        "on the command line overrides the YAML), or in code (`WeightSyncConfig(...)`, keyword-only). Every",
        "value is checked when the settings are made: a wrong one is a `ValueError` naming the field and",
        "the fix, and an unknown key is refused with the list of valid ones. Settings both jobs must agree",
        "on are compared when the inference job joins the trainer's session ([Faults](../faults.md)).",
        "",
        "| setting | default | allowed values |",
        "| --- | --- | --- |",
    ]
    for f in fields:
        shown = ("(section)", "") if f.section else (_code(f.default), allowed(f, choices))
        out.append(f"| [`{f.name}`](#{_anchor(f.name)}) | {shown[0]} | {shown[1]} |")
    out += ["", "## Fields"]
    for f in fields:
        out += ["", f"### `{f.name}` {{#{_anchor(f.name)}}}", ""]
        if f.section:
            out += [f"A section (`{f.section}`): its fields follow, written `{f.name}.<field>` here "
                    f"and nested under `{f.name}:` in YAML.", "", _escape(f.doc or "")]
            continue
        out += [
            "| type | default | allowed values | flag |",
            "| --- | --- | --- | --- |",
            f"| `{f.type}` | {_code(f.default)} | {allowed(f, choices)} | {_flag(f)} |",
            "",
            _escape(f.doc or ""),
        ]
    return "\n".join(out) + "\n"


def allowed(f: Field, choices: Mapping[str, Sequence[str]]) -> str:
    """Return the allowed values of `f`: its FIELD_CHOICES entry, else what its type admits."""
    optional = f.type.startswith("Optional[")
    base = f.type[len("Optional["):-1] if optional else f.type
    if f.name in choices:
        text = ", ".join(f"`{c}`" for c in choices[f.name])
    else:
        text = {
            "bool": "`true`, `false`",
            "int": "an integer",
            "float": "a number",
            "str": "a string",
            "tuple[str, ...]": "a list of strings",
            "tuple[int, ...]": "a list of integers",
        }.get(base, f"a `{base}`")
    return text + (", or `null`" if optional else "")


def _spelled(f: Field, spelling: Optional[tuple[str, str, Optional[str]]]) -> Field:
    if spelling is None:
        return f
    name, flag, old = spelling
    return Field(name, f.type, f.default, f.doc, f.line, f.section, flag, old)


def _flag(f: Field) -> str:
    if f.flag is None and "." in f.name:
        return "YAML only"
    flag = f.flag or FLAG_PREFIX + f.name.replace("_", "-")
    if f.old_flag:
        return f"`{flag}` (was `{f.old_flag}`)"
    if f.type == "bool":
        return f"`{flag}` / `--no-{flag[2:]}`"
    return f"`{flag}`" + (" (several values)" if f.type.startswith("tuple") else "")


def _anchor(name: str) -> str:
    return name.replace(".", "-")


def _code(text: Optional[str]) -> str:
    return "-" if text is None else f"`{text}`"


def _escape(text: str) -> str:
    """Return `text` with HTML-significant characters escaped outside `code spans` (docstrings are prose)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                   .replace("*", r"\*") for p in parts)


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _module_constants(tree: ast.Module) -> dict[str, Any]:
    """Return the module-level names bound to literals (a default may name one)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _fields_of(cls: ast.ClassDef, classes: Mapping[str, ast.ClassDef], constants: Mapping[str, Any], *,
               prefix: str, seen: tuple[str, ...]) -> list[Field]:
    out: list[Field] = []
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = inspect.cleandoc(nxt.value.value)
        annotation = ast.unparse(node.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        name = prefix + node.target.id
        section = _section(annotation, classes)
        if section is not None:
            if section in seen:
                raise ValueError(f"settings section {section!r} contains itself")
            out.append(Field(name, annotation, _default(node.value, constants), doc, node.lineno, section))
            out += _fields_of(classes[section], classes, constants, prefix=name + ".", seen=seen + (section,))
            continue
        out.append(Field(name, annotation, _default(node.value, constants), doc, node.lineno))
    return out


def _section(annotation: str, classes: Mapping[str, ast.ClassDef]) -> Optional[str]:
    """Return the dataclass an annotation names (plain or Optional[...]), or None."""
    inner = annotation[len("Optional["):-1] if annotation.startswith("Optional[") else annotation
    inner = inner.strip("'\"")
    return inner if inner in classes else None


def _default(value: Optional[ast.expr], constants: Mapping[str, Any]) -> Optional[str]:
    """Return the default as YAML spells it, or None when the field has none."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        keywords = {k.arg: k.value for k in value.keywords}
        if "default" in keywords:
            return _default(keywords["default"], constants)
        if "default_factory" in keywords:
            return f"{ast.unparse(keywords['default_factory'])}()"
        return None
    try:
        literal = ast.literal_eval(value)
    except ValueError:
        if isinstance(value, ast.Name) and value.id in constants:
            literal = constants[value.id]
        else:
            return ast.unparse(value)
    return _yaml(literal)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return repr(value)


def build_page(source_path: Path = CONFIG,
               choices_loader: Callable[[], Mapping[str, Sequence[str]]] = load_choices,
               spellings_loader: Callable[[], Mapping[str, tuple[str, str, Optional[str]]]] = load_spellings) -> str:
    """Return the page for the settings at `source_path`; ValueError lists every field it cannot document."""
    fields = parse_fields(source_path.read_text())
    found = problems(fields)
    if found:
        raise ValueError("the settings reference cannot be generated:\n  " + "\n  ".join(found))
    return render(fields, choices_loader(), spellings_loader())


# ---- the MkDocs hook ----

def on_files(files: Any, config: Any) -> Any:
    """Add the generated settings page to the build (MkDocs 1.6 hook); a field it cannot document fails it."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        content = build_page()
    except ValueError as e:
        raise PluginError(str(e)) from None
    files.append(File.generated(config, PAGE, content=content))
    return files
