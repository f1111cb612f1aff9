"""OSDP: Optimal Sharded Data Parallel for PyTorch."""

from osdp.plan import MODES, Plan, PlanError, UnitPlan

__all__ = ["MODES", "Plan", "PlanError", "UnitPlan"]
__version__ = "0.1.0"
