"""The previous release's import paths still work, each with a FutureWarning naming the new path (osdp._moved)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import osdp
from osdp import _moved


def _old(statement: str) -> dict:
    """Run an import statement of the old layout; what it bound, and the FutureWarnings it gave."""
    scope: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(statement, scope)
    return {"scope": scope, "warnings": [str(w.message) for w in caught if w.category is FutureWarning]}


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED_WHOLE.items()))
def test_a_module_moved_whole_is_the_new_module_itself(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported once already: it would not warn again
    out = _old(f"import {old} as m")
    assert out["scope"]["m"] is sys.modules[new]  # the same object: a patch of the old path reaches the new
    assert any(old in w and new in w for w in out["warnings"]), out["warnings"]


@pytest.mark.parametrize("statement, new", [
    ("from osdp.device import device_preset as x", "osdp.machine.presets.device_preset"),
    ("from osdp.device import parse_size as x", "osdp.sizes.parse_size"),
    ("from osdp.profile import describe as x", "osdp.describe.measured.describe"),
    ("from osdp.profile import cache_dir as x", "osdp.store.cache_dir"),
    ("from osdp.cost import predict as x", "osdp.cost.schedule.predict"),
    ("from osdp.cost import Calibration as x", "osdp.cost.terms.Calibration"),
    ("from osdp.calibration import calibrate as x", "osdp.calibration.measured.calibrate"),
    ("from osdp.machine import machine_info as x", "osdp.machine.identity.machine_info"),
    ("from osdp.granularity import build_problem as x", "osdp.cost.problem.build_block_problem"),
    ("from osdp.granularity import compose as x", "osdp.describe.granularity.compose"),
    ("from osdp.planner import search as x", "osdp.planner.find_plan"),
])
def test_a_name_of_an_old_module_is_found_where_it_lives_now(statement, new):
    module, _, name = new.rpartition(".")
    out = _old(statement)
    assert out["scope"]["x"] is getattr(sys.modules[module], name)
    assert any(new in w for w in out["warnings"]), out["warnings"]


def test_names_the_old_modules_never_had_are_still_errors():
    with pytest.raises(ImportError):
        _old("from osdp.cost import no_such_name")
    with pytest.raises(ImportError):
        _old("from osdp.device import no_such_name")


def test_osdp_plan_stays_the_function_and_the_new_paths_give_no_warning():
    out = _old("import osdp.schema.plan, osdp.runtime.dcp, osdp.cli.train, osdp.cost.schedule, osdp.planner")
    assert out["warnings"] == []
    assert callable(osdp.plan) and osdp.plan.__module__ == "osdp.planner"


def test_python_m_of_an_old_command_module_runs_the_new_one():
    proc = subprocess.run([sys.executable, "-m", "osdp.train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: osdp train")
    assert "python -m osdp.cli.train" in proc.stderr  # the FutureWarning, on stderr


def test_the_public_names_resolve_when_used_and_import_osdp_alone_needs_no_torch():
    """``osdp``'s names are imported when first used (``osdp --version`` answers without torch): each one in
    ``__all__`` resolves to the object its module defines, ``from osdp import *`` binds them all, and a
    subpackage is an attribute as after an eager import."""
    assert set(osdp.__all__) - {"__version__"} == set(osdp._PUBLIC)
    for name, module in osdp._PUBLIC.items():
        assert getattr(osdp, name) is getattr(importlib.import_module(module), name), name
    scope: dict = {}
    exec("from osdp import *", scope)
    assert {n: scope[n] for n in osdp.__all__} == {n: getattr(osdp, n) for n in osdp.__all__}
    assert osdp.models.build is importlib.import_module("osdp.models").build
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        osdp.no_such_name  # noqa: B018
    probe = "import sys, osdp; print(osdp.__version__, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [osdp.__version__, "False"], done.stderr
