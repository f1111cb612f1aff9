"""Import paths of the previous release, kept working for one more (with a ``FutureWarning`` naming the new one).

The package was laid out again by data flow (describe, machine, cost, search, apply, train, calibrate, plan,
commands). Every module of the old layout that no longer exists under its old name is found here: one that
moved whole is the new module itself (``import osdp.checkpoint`` gives ``osdp.runtime.dcp``, and ``python -m
osdp.train`` runs ``osdp.cli.train``); one that was split answers each name from the module that holds it now.
Old names of a module that is now a package of the same name (``osdp.calibration``, ``osdp.machine``,
``osdp.cost``) are answered by that
package's ``__getattr__`` (``old_names``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

RELEASE = "0.3"  # the release that drops these paths

# old module -> the module it now is
MOVED_WHOLE = {
    "osdp.train": "osdp.cli.train",
    "osdp.validate": "osdp.cli.validate",
    "osdp.plan_cli": "osdp.cli.plan",
    "osdp.checkpoint": "osdp.runtime.dcp",
    "osdp.harness": "osdp.runtime.jobs",
    "osdp.local_ranks": "osdp.distributed.local_ranks",
    "osdp.comm": "osdp.distributed.collectives",
    "osdp.timing": "osdp.machine.timing",
    "osdp.memory": "osdp.machine.memory",
    "osdp.units": "osdp.describe.units",
    "osdp.caches": "osdp.describe.forward_caches",
    "osdp.recompute": "osdp.describe.recompute",
    "osdp.analytic": "osdp.describe.analytic",
    "osdp.model_source": "osdp.describe.sources",
    "osdp.data": "osdp.models.data",
    "osdp.gradients": "osdp.fsdp_ext.gradients",
    "osdp.compile": "osdp.fsdp_ext.compile",
    "osdp.description": "osdp.schema.description",
}

# old module -> the modules its names are now in (looked up in this order)
MOVED_APART = {
    "osdp.device": ("osdp.machine.device_info", "osdp.machine.presets", "osdp.machine.collective_model",
                    "osdp.machine.measure", "osdp.sizes"),
    "osdp.profile": ("osdp.describe.measured", "osdp.describe.measure", "osdp.describe.batch",
                     "osdp.describe.attribution", "osdp.store"),
    "osdp.granularity": ("osdp.describe.granularity", "osdp.cost.problem", "osdp.cost.neighbours"),
}

# (old module, old name) -> (new module, new name), where the name changed too
RENAMED = {
    ("osdp.granularity", "build_problem"): ("osdp.cost.problem", "build_block_problem"),
    ("osdp.granularity", "neighbours"): ("osdp.cost.neighbours", "nested_neighbours"),
    ("osdp.planner", "search"): ("osdp.planner", "find_plan"),
    ("osdp.calibration", "main"): ("osdp.cli.calibrate", "main"),
    ("osdp.calibration", "build_parser"): ("osdp.cli.calibrate", "build_parser"),
}

# names of packages that kept their name: (package, old name) -> new module
MOVED_INTO = {
    "osdp.calibration": ("osdp.calibration.measured", "osdp.calibration.store", "osdp.calibration.nets",
                         "osdp.calibration.fit"),
    "osdp.machine": ("osdp.machine.identity",),
    "osdp.cost": ("osdp.cost.terms", "osdp.cost.unit", "osdp.cost.neighbours", "osdp.cost.context",
                  "osdp.cost.schedule", "osdp.cost.problem"),
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is now {new}; the old path goes in osdp {RELEASE}", FutureWarning, stacklevel=3)


def moved_attribute(module: str, name: str) -> object:
    """``name`` of the old ``module``, from where it lives now (a FutureWarning says where); AttributeError if
    the old module had no such name either."""
    if (module, name) in RENAMED:
        new_module, new_name = RENAMED[(module, name)]
        _warn(f"{module}.{name}", f"{new_module}.{new_name}")
        return getattr(importlib.import_module(new_module), new_name)
    holders = [importlib.import_module(m) for m in MOVED_APART.get(module, ()) + MOVED_INTO.get(module, ())]
    found = [h for h in holders if not name.startswith("__") and name in vars(h)]
    # the module that defines it, rather than one that imports it
    found.sort(key=lambda h: getattr(vars(h)[name], "__module__", h.__name__) != h.__name__)
    if found:
        _warn(f"{module}.{name}", f"{found[0].__name__}.{name}")
        return vars(found[0])[name]
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def old_names(module: str):
    """The module ``__getattr__`` of ``module`` (a package or module that kept its name) that answers the
    previous release's names in it: ``__getattr__ = old_names(__name__)``."""
    return lambda name: moved_attribute(module, name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        if old in MOVED_WHOLE:
            _warn(old, MOVED_WHOLE[old])
            sys.modules[old] = importlib.import_module(MOVED_WHOLE[old])  # the same module: patches reach it
        else:
            module.__getattr__ = lambda name: moved_attribute(old, name)

    def get_code(self, old: str) -> types.CodeType:  # python -m <old module>
        new = MOVED_WHOLE[old]
        _warn(f"python -m {old}", f"python -m {new}")
        return importlib.util.find_spec(new).loader.get_code(new)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in MOVED_WHOLE or name in MOVED_APART:
            return importlib.util.spec_from_loader(name, _Loader())
        return None


def install() -> None:
    """Answer the old paths (after every other finder: a module that exists is always itself)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
