"""OSDP: Optimal Sharded Data Parallel for PyTorch."""

from osdp.api import plan_of, strategy_plan, wrap
from osdp.plan import MODES, Plan, PlanError, UnitPlan
from osdp.units import Unit, discover_units

__all__ = ["MODES", "Plan", "PlanError", "Unit", "UnitPlan", "discover_units", "plan_of", "strategy_plan", "wrap"]
__version__ = "0.1.0"
