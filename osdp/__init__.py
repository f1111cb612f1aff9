"""OSDP: Optimal Sharded Data Parallel for PyTorch.

``osdp.plan`` is the search entry point (a function); the Plan data type
lives in the ``osdp.plan`` module and is exported here as ``osdp.Plan``.
"""

from osdp._version import __version__
from osdp.api import plan_of, set_requires_gradient_sync, strategy_plan, wrap
from osdp.calibration import calibrate
from osdp.compile import compile_units
from osdp.device import DeviceInfo, device_preset, list_presets, parse_size
from osdp.fsdp_ext.budget_check import BudgetExceededWarning
from osdp.fsdp_ext.replicas import ReplicaDivergence, check_replicas
from osdp.fsdp_ext.replicate import UnusedParametersError
from osdp.gradients import clip_grad_norm_
from osdp.plan import MODES, Plan, PlanError, UnitPlan
from osdp.search import BudgetTooSmall
from osdp.units import Unit, discover_units
from osdp.planner import plan  # noqa: E402 - after the osdp.plan module is loaded, the name is the function

__all__ = [
    "__version__", "MODES", "BudgetExceededWarning", "BudgetTooSmall", "DeviceInfo", "Plan", "PlanError", "ReplicaDivergence", "Unit",
    "UnitPlan", "calibrate", "check_replicas", "clip_grad_norm_", "compile_units", "device_preset", "discover_units", "list_presets", "parse_size", "plan", "plan_of",
    "set_requires_gradient_sync", "strategy_plan", "UnusedParametersError", "wrap",
]
