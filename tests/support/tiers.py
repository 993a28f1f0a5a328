"""The test tiers, as markers, and their enforcement: a test that starts a process says so.

| tier       | marker      | what its tests do                                              |
|------------|-------------|----------------------------------------------------------------|
| pure       | (none)      | run in the pytest process: functions, plans, in-process stores |
| multiproc  | `multiproc` | start worker processes (gloo ranks, helper scripts)            |
| e2e        | `e2e`       | launch the real command lines (torchrun jobs, `launch/*.sh`)   |
| engine     | `vllm`, `sglang` | start a real inference server                             |
| gpu        | `gpu`       | need CUDA; skipped without it                                  |

Two checks keep the markers true. At collection, a test whose own code, its
fixtures' code, or the test-support functions they call reach a
process-starting call (`subprocess`, a multiprocessing `Process`, the
harnesses built on them) without a process tier's marker fails the collection,
naming the test and the call. While running, a test that starts a process
anyway fails, and one that launches the real jobs or a server needs that
tier's marker (`e2e`, `vllm`, `sglang`), not only `multiproc`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing.process
import os
import subprocess
import sys
import textwrap
from typing import Any, Iterable, Optional

import pytest

TIERS = ("gpu", "vllm", "sglang", "e2e", "multiproc")
"""Process tiers from the most to the least demanding; a test's tier is the first marker it has, else "pure"."""
PROCESS_TIERS = frozenset(TIERS)
FAST_EXPRESSION = "not " + " and not ".join(TIERS)
"""The `-m` expression of `make test-fast`: the pure tier only."""

# What a launched command line says about the tier it needs: the program it runs (`-m MODULE`, a script,
# or the executable itself), first match wins.
LAUNCH_RULES = (
    ("vllm", ("vllm.entrypoints", "serve_vllm.sh", "vllm")),
    ("sglang", ("sglang.launch_server", "serve_sglang.sh")),
    ("e2e", ("torchrun", "torch.distributed.run", "examples.demo", "examples.job", "megatron_sync.drivers.serve",
             "megatron_sync.drivers.colocate", "megatron_sync.drivers.serve", "megatron_sync.drivers.colocate", "train.sh",
             "serve.sh", "colocate.sh")),
)
# Calls that start a process; the harness functions that wrap them are found by following calls.
STARTERS = frozenset({"subprocess.run", "subprocess.Popen", "subprocess.check_output", "subprocess.check_call",
                      "subprocess.call", "Popen", "Process", "spawn", "start_processes"})
TESTS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tier_of(item: Any) -> str:
    """Return the tier of a collected test (its most demanding process marker, else "pure")."""
    names = {m.name for m in item.iter_markers()}
    return next((t for t in TIERS if t in names), "pure")


def launched_program(argv: Iterable[str]) -> str:
    """Return what a command line runs: the module after `-m`, else the script a shell or python runs, else
    the executable."""
    argv = [str(a) for a in argv]
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    name = os.path.basename(argv[0]) if argv else ""
    if name in ("bash", "sh") or name.startswith("python"):
        script = next((a for a in argv[1:] if not a.startswith("-")), "")
        return os.path.basename(script)
    return name


def needed_for_launch(argv: Iterable[str]) -> Optional[str]:
    """Return the tier a command line needs beyond `multiproc` ("e2e", "vllm", "sglang"), or None."""
    program = launched_program(argv)
    return next((tier for tier, programs in LAUNCH_RULES if program in programs or
                 any(program.startswith(p + ".") for p in programs)), None)


# ---- collection: following the calls of the tests and of their support code ----

def _call_names(call: ast.Call) -> list[str]:
    """Return what a call names: `f` for f(...), and `x.f` plus `.f` for x.f(...)."""
    func = call.func
    if isinstance(func, ast.Name):
        return [func.id]
    if isinstance(func, ast.Attribute):
        names = ["." + func.attr]
        if isinstance(func.value, ast.Name):
            names.append(f"{func.value.id}.{func.attr}")
        return names
    return []


def _calls_in(node: ast.AST) -> set[str]:
    return {name for sub in ast.walk(node) if isinstance(sub, ast.Call) for name in _call_names(sub)}


CONSTRUCTION = ("__init__", "__post_init__", "__enter__")
"""The methods a class name's call runs (a harness class that starts its process when built)."""


class _Module:
    """One module of tests/: what its module-level functions and classes call, and the names it imports."""

    def __init__(self, tree: ast.Module) -> None:
        self.defs: dict[str, set[str]] = {}
        self.imported: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs[node.name] = _calls_in(node)
            elif isinstance(node, ast.ClassDef):
                self.defs[node.name] = set().union(*(
                    _calls_in(m) for m in node.body if isinstance(m, ast.FunctionDef) and m.name in CONSTRUCTION))
            elif isinstance(node, ast.ImportFrom):
                self.imported.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                self.imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names)


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, _Module]:
    """Return every module of tests/ by path."""
    found = {}
    for folder, _, files in os.walk(TESTS_ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found[path] = _Module(ast.parse(f.read()))
    return found


def _resolve(path: str, call: str) -> list[tuple[str, str]]:
    """Return the (module path, name) definitions a call in module `path` may run.

    A bare name is the module's own definition, else, when the module imports it, any module's; `m.f` where
    `m` is an imported name is any module's `f`; a method call `x.f` on an object is not followed."""
    modules, here = _modules(), _modules()[path]
    if "." not in call:
        if call in here.defs:
            return [(path, call)]
        return [(p, call) for p, m in modules.items() if call in m.defs] if call in here.imported else []
    owner, _, attr = call.partition(".")
    if owner and owner in here.imported:
        return [(p, attr) for p, m in modules.items() if attr in m.defs]
    return []


def _starter_path(path: str, calls: set[str]) -> Optional[list[str]]:
    """Return a chain of calls from `calls` (made in module `path`) to a process-starting call, or None."""
    seen: set[tuple[str, str]] = set()
    frontier = [(path, call, [call]) for call in sorted(calls)]
    while frontier:
        where, call, chain = frontier.pop(0)
        if call in STARTERS or call.lstrip(".") in ("Process", "Popen"):
            return chain
        for target in _resolve(where, call):
            if target in seen or target[1].startswith("test_"):
                continue
            seen.add(target)
            frontier.extend((target[0], callee, chain + [callee]) for callee in sorted(_modules()[target[0]].defs[target[1]]))
    return None


def _own_calls(func: Any) -> tuple[str, set[str]]:
    try:
        path, source = os.path.abspath(inspect.getsourcefile(func) or ""), textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return "", set()
    return path, _calls_in(ast.parse(source))


def process_path(item: Any) -> Optional[list[str]]:
    """Return how a collected test reaches a process-starting call (its code, then its fixtures'), or None."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    funcs += [fixture.func for defs in (info.name2fixturedefs.values() if info is not None else ()) for fixture in defs]
    for func in funcs:
        path, calls = _own_calls(func)
        if path in _modules():
            chain = _starter_path(path, calls)
            if chain is not None:
                return chain
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    _skip_gpu_without_cuda(items)
    unmarked = []
    for item in items:
        if tier_of(item) == "pure":
            path = process_path(item)
            if path is not None:
                unmarked.append(f"{item.nodeid}: {' -> '.join(path)}")
    if unmarked:
        raise pytest.UsageError(
            "tests that start processes must carry their tier's marker (multiproc, e2e, vllm, sglang or gpu; see "
            "tests/support/tiers.py):\n  " + "\n  ".join(unmarked))


def _skip_gpu_without_cuda(items) -> None:
    """Skip every gpu-marked test when no CUDA device is visible (the one place this is decided)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device here (make gpu-check runs it on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ---- running: the process starts themselves ----

_current: list[Any] = []  # the test running now (its setup, call and teardown)


def _refuse(kind: str, needs: Optional[str]) -> None:
    item = _current[-1] if _current else None
    if item is None:
        return  # outside a test (a session fixture's clean-up, the plugins themselves)
    have = {m.name for m in item.iter_markers()} & PROCESS_TIERS
    if not have:
        pytest.fail(f"{item.nodeid} starts a process ({kind}) but carries no process tier marker; mark it "
                    f"{needs or 'multiproc'} (tests/support/tiers.py)", pytrace=False)
    if needs is not None and needs not in have and not ({"vllm", "sglang"} & have and needs == "e2e"):
        pytest.fail(f"{item.nodeid} launches {kind}: mark it {needs}, not only {sorted(have)}", pytrace=False)


STDLIB = os.path.dirname(os.__file__)
REPO = os.path.dirname(TESTS_ROOT)


def _started_by_the_project() -> bool:
    """True when the nearest caller outside the standard library is this repository's code (a test, its
    support, the library or the examples): a library's own incidental commands (platform's `uname -p`) are
    not the test starting a process."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(STDLIB) or filename.startswith(REPO):
            return filename.startswith(REPO) and os.sep + ".venv" not in filename[len(REPO):]
        frame = frame.f_back
    return False


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self, args, *rest, **kwargs):
    argv = [args] if isinstance(args, (str, bytes)) else list(args)
    if _started_by_the_project():
        _refuse(f"the command {' '.join(map(str, argv))[:120]!r}", needed_for_launch(argv))
    _popen_init(self, args, *rest, **kwargs)


def _guarded_start(self):
    if _started_by_the_project():
        _refuse(f"a multiprocessing process ({getattr(self, 'name', '?')})", None)
    _process_start(self)


def pytest_configure(config) -> None:
    subprocess.Popen.__init__ = _guarded_popen_init
    multiprocessing.process.BaseProcess.start = _guarded_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()
