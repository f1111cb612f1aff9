"""Describe a model for the cost model: per unit, what it stores and how long it computes.

``describe(model, example_input)`` runs forward and backward on the device the
job runs on and measures, for every unit (``osdp.describe.units``):

* parameter shapes (exact; they give FSDP's padding, bytes and the split Linears);
* activation bytes saved for backward: saved-tensor hooks attribute each saved
  storage to the innermost unit running when autograd saves it (module hooks
  keep a stack), counted once however many views share it, parameters left out;
  and what checkpointing keeps instead (the unit's inputs);
* working sets: the peak of the unit's own live saved bytes plus all
  temporaries (logits on their way into the loss, gradients in flight) while
  its forward or backward runs, and when its backward ends, measured with
  ``osdp.machine.memory.LiveBytesTracker`` (``attribution._working_sets`` says exactly what);
* forward and backward compute time, timed per unit with the same attribution.

Everything is measured at a few micro-batch sizes and fitted linear in the
size. Units with the same ``signature`` (repeated blocks) get the average of
their times; memory stays per unit, because where a unit runs in the schedule
matters. The optimizer's step time per parameter byte is measured too. The
result is cached on disk (``OSDP_CACHE_DIR``, default ``~/.cache/osdp``), keyed
by everything that changes it, so a second ``describe`` of the same model is
instant.

The measuring passes are ``describe.measure``'s, what a unit's bytes and seconds are is
``describe.attribution``'s, how a batch is resized and fed is ``describe.batch``'s.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn as nn

from osdp.describe.attribution import synchronizer
from osdp.describe.cache import PROFILE_VERSION, cache_key, cached_path, model_fingerprint, read_cached
from osdp.describe.batch import ProfileError, batch_size_of, held_all_step, input_spec, resize_batch
from osdp.describe.kept import quietly
from osdp.describe.measure import (
    _device_of,
    _step,
    _time_at,
    fit_costs,
    in_precision,
    may_checkpoint,
    memory_pass,
    resolve_units,
    time_optimizers,
    unit_profiles,
)
from osdp.describe.units import Unit, checkpointable, structure_signature
from osdp.log import Progress
from osdp.machine.identity import device_name
from osdp.machine.timing import StepTimer
from osdp.schema.description import PRECISIONS, ModelDescription, UnitWorkload
from osdp.store import write_atomically





# --------------------------------------------------------------------------- entry point


def describe(
    model: nn.Module,
    example_input: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    batch_sizes: Sequence[int] | None = None,
    precisions: Sequence[str] = ("fp32",),
    units: Sequence[Unit] | None = None,
    granularity: str = "sub-block",
    optimizers: Sequence[str] = ("sgd", "sgd-momentum", "adamw"),
    repeats: int | None = None,
    time_budget_s: float = 20.0,
    cache: bool = True,
    progress: bool = True,
    name: str | None = None,
    checkpoint_policies: Sequence[str] = ("full", "selective"),
    uneven: Sequence[str] = (),
    unless_units: Collection[frozenset[str]] = (),
    example_kept_bytes: int | None = None,
) -> ModelDescription | None:
    """Measure ``model`` on the device its parameters are on (see the module docstring).

    ``example_input``: a tensor (one argument), a tuple (positional arguments)
    or a dict (keyword arguments), batch in dim 0. The model must return a
    scalar loss, or ``loss_fn(output)`` must. ``batch_sizes`` default to half
    the example's and the example's. ``precisions``: "fp32" and/or "bf16"
    (measured as FSDP's mixed precision computes: ``osdp.describe.measure.in_precision``). ``units``
    default to ``osdp.discover_units`` at ``granularity`` with call counts, so
    a module that runs twice per forward is merged into its parent. ``checkpoint_policies``: the
    checkpointing whose recompute is timed (a unit not described for one is not offered it). ``uneven``: the
    modules other ranks' examples called a different number of times (``osdp.describe.units.uneven_calls``):
    no units of their own. The model's parameters, gradients, buffers, modules' plain attributes (a step
    counter) and RNG state are left as they were, and the user's hooks do not see the measuring passes
    (``osdp.describe.kept``). ``unless_units``: unit path sets already described (at another granularity):
    None, after one checked forward, where the units found are one of them. ``example_kept_bytes``: what the
    example's forward keeps for backward (``osdp.describe.batch.kept_for_backward``), where the planner chose it
    among the ranks' examples for it: a batch of the same shapes keeping other bytes is described again.
    """
    return quietly(model, lambda: _describe(
        model, example_input, loss_fn=loss_fn, batch_sizes=batch_sizes, precisions=precisions, units=units,
        granularity=granularity, optimizers=optimizers, repeats=repeats, time_budget_s=time_budget_s, cache=cache,
        progress=progress, name=name, checkpoint_policies=tuple(checkpoint_policies), uneven=tuple(uneven),
        unless_units=unless_units, example_kept_bytes=example_kept_bytes))


def _describe(model, example_input, *, loss_fn, batch_sizes, precisions, units, granularity, optimizers, repeats,
              time_budget_s, cache, progress, name, checkpoint_policies, uneven,
              unless_units, example_kept_bytes) -> ModelDescription | None:
    start = time.perf_counter()
    params = list(model.parameters())
    if not params:
        raise ProfileError("the model has no parameters: there is nothing to describe")
    device = params[0].device
    if device.type == "meta":
        raise ProfileError("the model is on the meta device: describe it with osdp.describe.analytic.describe_analytic")
    for p in precisions:
        if p not in PRECISIONS:
            raise ProfileError(f"precision {p!r} is not one of {list(PRECISIONS)}")
    n = batch_size_of(example_input)
    sizes = tuple(sorted(set(batch_sizes or (max(1, n // 2), n))))
    if sizes[0] < 1:
        raise ProfileError(f"batch sizes must be >= 1, got {list(sizes)}")
    name = name or getattr(getattr(model, "config", None), "name", None) or type(model).__name__
    show = Progress(f"describe {name}", progress)

    show("checking the forward")
    given_units = units
    units, routed, held = resolve_units(model, resize_batch(example_input, sizes[0]), loss_fn, units, granularity,
                                        uneven)
    if frozenset(u.path for u in units) in unless_units:
        show.done("the same units as another granularity's")
        return None

    key_parts = {
        "version": PROFILE_VERSION, "model": model_fingerprint(model), "units": [u.path for u in units],
        "input": input_spec(example_input), "sizes": sizes, "precisions": list(precisions),
        "device": device_name(device), "torch": torch.__version__, "optimizers": list(optimizers),
        "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)) if loss_fn else None,
        "checkpoint_policies": list(checkpoint_policies), "uneven": list(uneven),
        # a description timed over fewer steps (the tests' calibration profile's) is not one to plan with
        "timing": [repeats, time_budget_s],
    }
    if example_kept_bytes is not None:
        key_parts["kept_for_backward"] = example_kept_bytes
    key = cache_key(key_parts)
    path = cached_path(key)
    cached = read_cached(path) if cache else None
    if cached is not None:
        show.done(f"from cache {path}")
        return cached

    saved_grads = {p: p.grad for p in params}
    costs: dict[str, dict[str, UnitWorkload]] = {}
    checks: dict[str, Any] = {}
    try:
        for prec in precisions:
            budget_s = time_budget_s / len(precisions)
            costs[prec], checks[prec], order = _measure_precision(
                model, units, example_input, sizes, prec, loss_fn, repeats, budget_s, show, checkpoint_policies, routed)
        show("timing the optimizers")
        opt = time_optimizers(params, optimizers)
    finally:
        for p, g in saved_grads.items():
            p.grad = g
    description = ModelDescription(
        model=name,
        signature=structure_signature(model),
        units=unit_profiles(model, units, costs, routed),
        batch_sizes=sizes,
        precisions=tuple(precisions),
        optimizer_s_per_byte=opt,
        source=f"measured on {device_name(device)}",
        device=device_name(device),
        **held_all_step(model, example_input, held, sizes[0]),
        forward_order=tuple(order),
        checks=checks,
        profile_seconds=time.perf_counter() - start,
        cache_key=key,
        granularity=granularity if given_units is None else "given",
        routed=routed,
    )
    show.done(f"done in {description.profile_seconds:.1f}s")
    if cache:
        write_atomically(path, description.to_json())
    return description


def _measure_precision(model: nn.Module, units: Sequence[Unit], example_input: Any, sizes: tuple[int, ...],
                       prec: str, loss_fn, repeats: int | None, time_budget_s: float, show: Progress,
                       policies: tuple[str, ...], routed: Sequence[str]
                       ) -> tuple[dict[str, UnitWorkload], dict[str, Any], list[str]]:
    """Every unit's workload at precision ``prec`` (memory and time at each micro-batch size, fitted linear in
    it; ``routed``: the routed containers, see ``memory_pass``), the timed steps' checks, and the order the units
    ran in."""
    with in_precision(model, units, PRECISIONS[prec]) if prec != "fp32" else contextlib.nullcontext():
        sync = synchronizer(next(model.parameters()).device)
        show(f"{prec}: warm-up")
        step_s = _warm_up(model, resize_batch(example_input, sizes[-1]), loss_fn)
        # as many repeats as the time budget holds, 1 to 7 (a step of a large model that takes seconds is timed
        # once; so are all with no budget: the tests' calibration profile, whose plans' speed is not judged)
        reps = repeats or max(1, min(7, int(time_budget_s / max(step_s, 1e-4) / 2.5 / len(sizes))))
        memory, seconds, checks, order = {}, {}, {}, []
        policies = policies if checkpointable(units) else ()
        recompute: dict[str, dict[int, dict[str, float]]] = {p: {} for p in policies}
        for i, b in enumerate(sizes):
            show(f"{prec}: micro-batch {b} ({i + 1}/{len(sizes)}), {reps} timed steps")
            batch = resize_batch(example_input, b)
            memory[b], order = memory_pass(model, units, batch, loss_fn, routed=routed)
            takers = {p: may_checkpoint(units, memory[b], p) for p in policies}
            timing = _time_at(model, units, batch, loss_fn, reps, sync, takers)
            seconds[b] = timing["seconds"]
            checks[str(b)] = {k: timing[k] for k in ("step_s", "hooked_step_s")}
            for policy in policies:
                recompute[policy][b] = timing["recompute_seconds"][policy]
        costs = fit_costs(units, sizes, memory, seconds, recompute_seconds=recompute or None)
        return costs, checks, order


def describe_once(model: nn.Module, example_input: Any, **settings: Any) -> ModelDescription:
    """Collective: rank 0 describes ``model`` (``describe(**settings)``) while the other ranks wait, and every
    rank gets its description, or raises its error.

    This is how the planner describes a model in a job, so the calibration
    (``osdp.calibration``) describes its synthetic models the same way: a
    description is timed on one rank with the others idle, and the
    calibration's compute scale says how much slower the job computes.
    """
    from osdp.distributed import broadcast_object, world

    rank, _ = world()
    outcome: tuple[str, Any] = ("", None)
    if rank == 0:
        try:
            outcome = ("description", describe(model, example_input, **settings))
        except Exception as e:  # noqa: BLE001 - every rank must raise it, not wait forever
            outcome = ("error", e)
    kind, payload = broadcast_object(outcome)
    if kind == "error":
        raise payload
    return payload


def _warm_up(model: nn.Module, batch: Any, loss_fn) -> float:
    """Two steps (first-call costs, allocator warm-up); returns the second's seconds."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with StepTimer(_device_of(model)) as step:
            _step(model, batch, loss_fn)
    model.zero_grad(set_to_none=True)
    return step.seconds
