"""The shipped modules form no import cycle, and each imports alone.

The graph counts every import of a shipped module anywhere in a module (top level, `if TYPE_CHECKING:`
blocks, and inside functions, where a cycle would only be hidden): data and rules at the bottom
(`meta`, `layout`, `megatron_sync.convert`, `config`), mechanisms in the middle, drivers at the top. Then, in a
fresh interpreter, each shipped module is imported first, alone (the others dropped from
`sys.modules` between imports), which an import-order-dependent cycle would break.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_sync",)


def shipped_modules() -> dict[str, str]:
    """Return module name -> file of every module of the shipped packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def imports_of(module: str, path: str, known: set[str]) -> set[str]:
    """Return the shipped modules `module` imports anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_shipped_modules_import_each_other_without_a_cycle():
    modules = shipped_modules()
    graph = {m: imports_of(m, path, set(modules)) for m, path in modules.items()}
    assert "megatron_sync.layout.staging" in graph["megatron_sync.transports.buckets.receiver"]  # the graph sees real imports
    assert cycles(graph) == []


def folder_of(module: str) -> str:
    """Return the folder a shipped module lives in: `megatron_sync.<folder>`, or `megatron_sync` itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or os.path.isdir(os.path.join(ROOT, *parts)) else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Return folder -> {folder it imports: the module imports that make the arrow}."""
    folders: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        arrows = folders.setdefault(folder_of(module), {})
        for target in targets:
            if folder_of(target) != folder_of(module):
                arrows.setdefault(folder_of(target), []).append(f"{module} -> {target}")
    return folders


def test_no_two_folders_import_each_other_and_the_folders_stack_without_a_cycle():
    """Data and rules at the bottom (core, convert, settings, layout), drivers at the top: every arrow between
    folders points one way. A registry filled by import paths (strings) is not an import."""
    modules = shipped_modules()
    folders = folder_graph({m: imports_of(m, path, set(modules)) for m, path in modules.items()})
    assert "megatron_sync.core" in folders["megatron_sync.transports"]  # the graph sees real arrows
    mutual = [f"{a} <-> {b}: {folders[a][b][:2]} / {folders[b][a][:2]}" for a in folders for b in folders[a]
              if a < b and a in folders.get(b, {})]
    assert mutual == []
    assert cycles({f: set(arrows) for f, arrows in folders.items()}) == []
    assert folders["megatron_sync.core"] == {}  # the bottom layer imports nothing of the package


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


PROBE = r"""
import importlib, json, sys
failed = {}
for module in MODULES:
    for name in [m for m in sys.modules if m.split(".")[0] in ("megatron_sync", "megatron_sync.convert")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:
        failed[module] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_every_shipped_module_imports_alone():
    modules = sorted(shipped_modules())
    done = subprocess.run([sys.executable, "-c", f"MODULES = {modules!r}\n" + PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=540, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 50


def _shipped_sources():
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        yield os.path.relpath(path, ROOT), f.read()


def test_modules_stay_short_functions_stay_short_and_no_two_classes_share_a_name():
    """The layout's size rules: no shipped module over 400 lines, no function over 50, one class per name."""
    long_modules, long_functions, classes = [], [], {}
    for path, source in _shipped_sources():
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append((path, source.count("\n")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((path, node.name, lines))
            elif isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(path)
    assert long_modules == [], f"split these modules (over {MAX_MODULE_LINES} lines): {long_modules}"
    assert long_functions == [], f"split these functions (over {MAX_FUNCTION_LINES} lines): {long_functions}"
    assert {n: p for n, p in classes.items() if len(p) > 1} == {}, "two classes with one name"


BROAD = {"Exception", "BaseException"}


def _is_broad(kind) -> bool:
    if kind is None:
        return True
    if isinstance(kind, ast.Name):
        return kind.id in BROAD
    return isinstance(kind, ast.Tuple) and any(_is_broad(k) for k in kind.elts)


def broad_handlers_without_a_reason(path: str, source: str) -> list[str]:
    """Return the broad `except` clauses of `source` (bare, Exception, BaseException) that neither raise again
    (clean up, then re-raise or raise a clearer error) nor say on their line why they keep going."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _is_broad(node.type):
            raises = any(isinstance(n, ast.Raise) for n in ast.walk(ast.Module(body=node.body, type_ignores=[])))
            said = "#" in lines[node.lineno - 1].partition("except")[2]
            if not raises and not said:
                found.append(f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_broad_except_raises_again_or_says_why_it_keeps_going():
    """The broad-except audit as a rule: a handler that swallows everything must say why on its line."""
    found = [h for path, source in _shipped_sources() for h in broad_handlers_without_a_reason(path, source)]
    assert found == [], "raise again, catch something narrower, or say why on the except line:\n" + "\n".join(found)


def test_the_audit_finds_a_silent_broad_except():
    silent = "try:\n    f()\nexcept Exception:\n    pass\n"
    said = "try:\n    f()\nexcept Exception:  # noqa: BLE001 - logged by the caller\n    pass\n"
    cleaned = "try:\n    f()\nexcept BaseException:\n    undo()\n    raise\n"
    narrow = "try:\n    f()\nexcept OSError:\n    pass\n"
    assert broad_handlers_without_a_reason("m.py", silent) == ["m.py:3: except Exception:"]
    assert [broad_handlers_without_a_reason("m.py", s) for s in (said, cleaned, narrow)] == [[], [], []]
