"""The public entry points: ``osdp.wrap`` and ``osdp.plan_of``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from osdp.fsdp_ext.apply import apply_plan, plan_of
from osdp.plan import STRATEGIES, Plan, PlanError
from osdp.units import discover_units


def strategy_plan(model: nn.Module, strategy: str, **settings: Any) -> Plan:
    """A baseline plan over the model's default units: ``ddp``, ``zero2`` or ``fsdp``."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy '{strategy}'; use one of {', '.join(sorted(STRATEGIES))}")
    return Plan.for_strategy([u.path for u in discover_units(model)], strategy, **settings)


def wrap(
    model: nn.Module,
    *,
    plan: Plan | str | None = None,
    strategy: str | None = None,
    device: torch.device | str | None = None,
    mixed_precision: str | None = None,
) -> nn.Module:
    """Apply a plan (a :class:`Plan` or its JSON) or a baseline strategy to ``model`` in place.

    Collective: every rank of the default process group calls it with the same
    plan. Returns the model, now managed by FSDP2; ``osdp.plan_of(model)`` gives
    the plan that was applied.
    """
    if (plan is None) == (strategy is None):
        raise ValueError("osdp.wrap needs exactly one of plan=... or strategy=... (" + ", ".join(sorted(STRATEGIES)) + ")")
    if isinstance(plan, str):
        plan = Plan.from_json(plan)
    if strategy is not None:
        plan = strategy_plan(model, strategy)
    if mixed_precision is not None:
        plan.mixed_precision = mixed_precision
        plan.__post_init__()
    return apply_plan(model, plan, device=device)


__all__ = ["wrap", "plan_of", "strategy_plan"]
