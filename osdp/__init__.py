"""OSDP: Optimal Sharded Data Parallel for PyTorch.

``osdp.wrap(model, device_mem=..., example_input=...)`` plans and applies; ``osdp.plan`` (a function) only
plans; ``osdp.Plan`` is the plan's type (``osdp.schema.plan``). The package follows the data flow: a model is
described (``describe``), the machine measured (``machine``, ``calibration``), every plan priced (``cost``),
the fastest that fits searched (``search``, ``planner``), applied with FSDP2 (``fsdp_ext``, ``split``) and
trained (``runtime``, ``cli``, ``integrations``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from osdp import _moved
from osdp._version import __version__

# Each public name and the module it lives in, imported when first used: ``osdp --version`` and a command's
# help need no torch, and a command imports only what it runs (the whole package takes seconds to import).
_PUBLIC = {
    # the entry points
    "plan_of": "osdp.api", "set_requires_gradient_sync": "osdp.api", "strategy_plan": "osdp.api",
    "wrap": "osdp.api", "plan": "osdp.planner", "MODES": "osdp.schema.plan", "Plan": "osdp.schema.plan",
    "UnitPlan": "osdp.schema.plan", "Unit": "osdp.describe.units", "discover_units": "osdp.describe.units",
    # helpers the README documents
    "calibrate": "osdp.calibration.measured", "compile_units": "osdp.fsdp_ext.compile",
    "clip_grad_norm_": "osdp.fsdp_ext.gradients", "check_replicas": "osdp.fsdp_ext.replicas",
    "DeviceInfo": "osdp.machine.device_info", "device_preset": "osdp.machine.presets",
    "list_presets": "osdp.machine.presets", "parse_size": "osdp.sizes",
    # what a user may catch
    "CalibrationError": "osdp.calibration.nets", "ProfileError": "osdp.describe.batch",
    "PeerFailure": "osdp.distributed", "BudgetExceededWarning": "osdp.fsdp_ext.budget_check",
    "DivideFactorWarning": "osdp.fsdp_ext.divide_factors",
    "WrappedTwiceError": "osdp.fsdp_ext.module_api", "ReplicaDivergence": "osdp.fsdp_ext.replicas",
    "UnusedParametersError": "osdp.fsdp_ext.replicate", "CheckpointError": "osdp.runtime.dcp",
    "PlanError": "osdp.schema.plan", "BudgetTooSmall": "osdp.search",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:  # a subpackage used as an attribute (``osdp.models.build``), as after an eager import
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:
    from osdp.api import plan_of, set_requires_gradient_sync, strategy_plan, wrap
    from osdp.calibration.measured import calibrate
    from osdp.calibration.nets import CalibrationError
    from osdp.describe.batch import ProfileError
    from osdp.describe.units import Unit, discover_units
    from osdp.distributed import PeerFailure
    from osdp.fsdp_ext.budget_check import BudgetExceededWarning
    from osdp.fsdp_ext.compile import compile_units
    from osdp.fsdp_ext.divide_factors import DivideFactorWarning
    from osdp.fsdp_ext.gradients import clip_grad_norm_
    from osdp.fsdp_ext.module_api import WrappedTwiceError
    from osdp.fsdp_ext.replicas import ReplicaDivergence, check_replicas
    from osdp.fsdp_ext.replicate import UnusedParametersError
    from osdp.machine.device_info import DeviceInfo
    from osdp.machine.presets import device_preset, list_presets
    from osdp.planner import plan
    from osdp.runtime.dcp import CheckpointError
    from osdp.schema.plan import MODES, Plan, PlanError, UnitPlan
    from osdp.search import BudgetTooSmall
    from osdp.sizes import parse_size

_moved.install()  # the previous release's import paths, for one more release

__all__ = [
    "__version__", "wrap", "plan", "plan_of", "strategy_plan", "set_requires_gradient_sync", "Plan", "UnitPlan",
    "MODES", "Unit", "discover_units", "calibrate", "compile_units", "clip_grad_norm_", "check_replicas",
    "DeviceInfo", "device_preset", "list_presets", "parse_size", "BudgetExceededWarning", "BudgetTooSmall",
    "CalibrationError", "CheckpointError", "DivideFactorWarning", "PeerFailure", "PlanError", "ProfileError", "ReplicaDivergence",
    "UnusedParametersError", "WrappedTwiceError",
]
