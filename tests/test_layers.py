"""The package imports in the order of its data flow: describe, cost, search, plan, apply, train.

Every import of one osdp module by another, lazy ones (inside a function) included, read from the source with
``ast``: no module imports one of a later stage (``LAYERS``), and no import cycle. A new module must be given a
stage here; one that needs a later stage is in the wrong place, or needs its dependency turned around.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "osdp"

# The stages, first to last; a module (or a package, for all its modules) is in one.
LAYERS: list[tuple[str, list[str]]] = [
    # osdp._moved (the previous release's paths) names later modules by string only, imported on use
    ("plain data and tools", ["osdp._version", "osdp._torch_private", "osdp._moved", "osdp.sizes", "osdp.log",
                              "osdp.store", "osdp.schema", "osdp.search"]),
    ("ranks", ["osdp.distributed"]),
    ("the machine", ["osdp.machine"]),
    ("built-in models and optimizers", ["osdp.models", "osdp.optim"]),
    ("operator splitting", ["osdp.split"]),
    ("describe", ["osdp.describe"]),
    ("cost", ["osdp.cost"]),
    ("tables", ["osdp.report"]),
    ("apply", ["osdp.fsdp_ext"]),
    ("train", ["osdp.runtime"]),
    ("calibrate", ["osdp.calibration"]),
    ("plan", ["osdp.planner"]),
    ("the public API", ["osdp.api", "osdp"]),
    ("commands and integrations", ["osdp.cli", "osdp.integrations"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _stage(module: str) -> int:
    best, stage = "", None
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > len(best):
                best, stage = m, i
    if stage is None:
        raise AssertionError(f"{module} has no stage in tests/test_layers.py: LAYERS")
    return stage


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The osdp modules ``name`` imports, anywhere in it (``from osdp import comm`` is osdp.distributed.collectives, not the
    package's facade; ``import osdp`` is the facade)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [*subs, base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("osdp") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_stage():
    for name in _modules():
        _stage(name)


def test_no_module_imports_a_later_stage():
    upward = [f"{a} ({LAYERS[_stage(a)][0]}) imports {b} ({LAYERS[_stage(b)][0]})"
              for a, targets in _graph().items() for b in targets if _stage(b) > _stage(a)]
    assert not upward, "imports against the flow:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# --------------------------------------------------------------------------- the size of the rooms

MAX_TOP_LEVEL_MODULES = 12  # directly in osdp/: the rest lives in the packages of the flow
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_LONG_FUNCTIONS = 3  # each with a comment right above it, starting "# Over 80 lines:", saying why


def test_few_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_few_functions_are_over_80_lines_and_each_says_why():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    above = lines[first - 2].strip() if first > 1 else ""
                    while above.startswith("#") and not above.startswith("# Over 80 lines:") and first > 2:
                        first -= 1
                        above = lines[first - 2].strip()
                    long.append((f"{path.relative_to(PACKAGE.parent)}:{node.name}",
                                 above.startswith("# Over 80 lines:")))
    assert len(long) <= MAX_LONG_FUNCTIONS, long
    assert all(says_why for _, says_why in long), [name for name, says_why in long if not says_why]
