"""The public entry points: ``osdp.wrap`` and ``osdp.plan_of``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from osdp.describe.units import CallTrace, discover_units
from osdp.distributed import broadcast_object, ensure_process_group, job_device, raise_on_any_rank
from osdp.fsdp_ext.apply import apply_plan, make_contiguous, plan_of, set_requires_gradient_sync
from osdp.fsdp_ext.model_checks import check_model
from osdp.fsdp_ext.budget_check import check_first_step
from osdp.schema.plan import STRATEGIES, Plan, PlanError


def strategy_plan(model: nn.Module, strategy: str, example_input: Any = None, **settings: Any) -> Plan:
    """A baseline plan over the model's default units: ``ddp``, ``zero2`` or ``fsdp``.

    With ``example_input`` (collective then: every rank passes its own), the units are found as the search finds
    them, from a forward of the example: parameters used outside their module's forward (a head tied by
    ``F.linear(x, self.wte.weight)``), modules called twice or writing to their inputs, and modules called
    depending on the data on any rank (a mixture of experts' experts) are no units of their own. Without it,
    from the model's structure alone."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy '{strategy}'; use one of {', '.join(sorted(STRATEGIES))}")
    if example_input is None:
        return Plan.for_strategy([u.path for u in discover_units(model)], strategy, **settings)
    calls = _calls_of_example(model, example_input)
    paths = broadcast_object([u.path for u in discover_units(model, calls)])  # rank 0's, where a trace differs
    return Plan.for_strategy(paths, strategy, routed=list(calls.uneven), **settings)


def _calls_of_example(model: nn.Module, example_input: Any) -> CallTrace:
    """Collective: this rank's trace of a forward of its example, naming what any rank calls depending on the
    data (``osdp.planner.calls_on_every_rank``); the same error on every rank if a forward failed."""
    from osdp.planner import calls_on_every_rank

    calls = calls_on_every_rank(model, example_input)
    error: Exception | None = None
    if calls is None:
        error = PlanError("the model's forward failed on the example_input of some rank; call model(example_input) "
                          "(model(*example_input) for a tuple, model(**example_input) for a dict) to see why")
    raise_on_any_rank(error)
    return calls


def _with_data_dependent_calls(model: nn.Module, plan: Plan, example_input: Any) -> Plan:
    """``plan`` naming as routed the modules some rank's example calls depending on the data (collective)."""
    missing = [path for path in _calls_of_example(model, example_input).uneven if path not in plan.routed]
    if not missing:
        return plan
    plan = Plan.from_json(plan.to_json())
    plan.routed = sorted([*plan.routed, *missing])
    return plan


def _plan_to_apply(model: nn.Module, device_mem, plan, strategy, example_input, mixed_precision,
                   plan_options: dict[str, Any]) -> Plan:
    """The plan ``wrap`` applies: searched under ``device_mem``, given, or a baseline's (collective)."""
    if device_mem is not None:
        from osdp.planner import plan as search_plan

        planning_device = plan_options.pop("planning_device", None)
        plan = search_plan(
            model, device_mem=device_mem, example_input=example_input, device=planning_device,
            mixed_precision=mixed_precision or "fp32", **plan_options,
        )
    elif strategy is not None:
        plan = strategy_plan(model, strategy, example_input)
    else:
        plan = Plan.from_json(plan) if isinstance(plan, str) else plan
        if example_input is not None:
            plan = _with_data_dependent_calls(model, plan, example_input)
    if mixed_precision is not None:
        plan.mixed_precision = mixed_precision
        plan.__post_init__()
    return plan


def wrap(
    model: nn.Module,
    *,
    device_mem: int | str | None = None,
    example_input: Any = None,
    plan: Plan | str | None = None,
    strategy: str | None = None,
    device: torch.device | str | None = None,
    mixed_precision: str | None = None,
    find_unused_parameters: bool | None = None,
    check_budget: bool = True,
    **plan_options: Any,
) -> nn.Module:
    """Make ``model`` data parallel in place, under a memory budget, a given plan, or a baseline.

    * ``wrap(model, device_mem="16GiB", example_input=batch)``: measure, search
      the fastest plan that fits the budget per rank, apply it (``plan_options``
      go to :func:`osdp.plan`: ``batch_sizes``, ``optimizer``, ``loss_fn``, and
      ``planning_device`` for a preset name);
    * ``wrap(model, plan=plan)``: apply a :class:`Plan` or its JSON;
    * ``wrap(model, strategy="fsdp")``: a baseline, ``ddp``, ``zero2`` or ``fsdp``.

    ``example_input`` with ``plan`` or ``strategy`` (every rank its own micro-batch): a forward of it finds what
    the model's structure does not tell. A baseline's units are then found as the search finds them (a
    parameter used outside its module's forward, such as a head tied by ``F.linear(x, self.wte.weight)``, keeps
    its module from being a unit of its own: see :func:`strategy_plan`); and modules called depending on the
    data (a mixture of experts' experts, a branch some rows take) are named in the plan's ``routed`` if it
    lacks them, so that ranks whose batches skip some never wait at different collectives. Models doing
    either need it.

    Whatever the plan, the model answers as a ``fully_shard``-ed one:
    ``model.set_requires_gradient_sync(False)`` and FSDP2's other methods, on
    the model, on every unit and on every module a user could have
    ``fully_shard``-ed (a block the plan took apart acts on the units inside it);
    parameters left without a gradient in a
    step, ``requires_grad`` changed between steps, and
    ``torch.nn.utils.clip_grad_norm_`` where FSDP2 supports it
    (``osdp.clip_grad_norm_`` everywhere). ``find_unused_parameters`` is
    ignored (kept for code written against osdp 0.x).

    With ``device_mem``, the first training step is measured (CUDA's
    allocator peak, or a live-bytes tracker on CPU, for that step only) and
    a peak over the budget warns on that rank (``BudgetExceededWarning``);
    ``check_budget=False`` turns that off.

    A model compiled before (``torch.compile(model)``) is wrapped in its compiled module and returned compiled.
    A model built on the meta device is wrapped as FSDP2 takes one (a budget's search describes it from its
    shapes); give it memory and values before its first forward: ``model.to_empty(device=...)``, then your
    initialisation or a checkpoint (replicated parameters take rank 0's values at that forward).

    Collective: every rank of the default process group calls it the same way.
    Returns the model, now managed by FSDP2; ``osdp.plan_of(model)`` gives the
    plan that was applied.
    """
    given = [name for name, value in (("device_mem", device_mem), ("plan", plan), ("strategy", strategy)) if value is not None]
    if len(given) != 1:
        raise ValueError(
            "osdp.wrap needs exactly one of device_mem=... (with example_input=...), plan=... or strategy=... "
            f"({', '.join(sorted(STRATEGIES))}); got {given or 'none'}"
        )
    if plan_options and device_mem is None:
        raise ValueError(f"{sorted(plan_options)} only apply with device_mem=...")
    if device_mem is not None and example_input is None:
        raise ValueError("osdp.wrap(device_mem=...) needs example_input=... (one micro-batch) to measure the model")
    compiled = model
    model = compiled_module(model)  # torch.compile(model)'s module: wrapped in place, called through the compiled one
    ensure_process_group()
    error: PlanError | None = None
    try:  # before the search's collectives and any look at the units: a model that cannot be wrapped fails now
        check_model(model, torch.device(device) if device is not None else job_device())
    except PlanError as e:
        error = e
    raise_on_any_rank(error)
    make_contiguous(model)  # as apply_plan lays the parameters out, before the search measures the model
    plan = _plan_to_apply(model, device_mem, plan, strategy, example_input, mixed_precision, plan_options)
    model = apply_plan(model, plan, device=device, find_unused_parameters=find_unused_parameters)
    if device_mem is not None and check_budget:
        check_first_step(model, torch.device(device) if device is not None else job_device(),
                         plan.meta["budget_bytes"], plan.predicted_peak_bytes)
    return model if compiled is model else compiled


def compiled_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` compiled, else ``model``: FSDP2's and osdp's hooks go on it, and the
    compiled wrapper (which hands its attributes through: ``plan_of``, FSDP2's methods) runs its forward with them,
    breaking its graph at FSDP2's hooks, as ``model.compile()`` on a wrapped model does."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


__all__ = ["wrap", "plan_of", "set_requires_gradient_sync", "strategy_plan"]
