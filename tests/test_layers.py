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
