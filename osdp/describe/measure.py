"""The measuring passes of the describe: a checked forward that finds the units that run, a memory pass
and timed passes per micro-batch size (plain and checkpointed), the optimizers' step, and the fit of
all of it linear in the micro-batch size.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from osdp._torch_private import module_tracker
from osdp.describe.attribution import (
    InPlaceWrites,
    KeptBySelective,
    LinearRows,
    Segments,
    UnrunMembers,
    _Saved,
    _Timer,
    _working_sets,
)
from osdp.describe.batch import ProfileError, call_model, held_output_bytes, loss_of, state_storage_keys, without_grad
from osdp.describe.forward_caches import disable_caches_in_training
from osdp.describe.recompute import checkpoint_unit, undo_checkpoint
from osdp.describe.units import (
    CallTrace,
    Unit,
    build_units,
    checkpointable,
    discover_units,
    enclosing,
    holding_unit,
    param_homes,
    routed_containers,
    sparse_gradients_message,
    trace_calls,
)
from osdp.machine.memory import LiveBytesTracker, iter_tensors
from osdp.machine.timing import StepTimer
from osdp.optim import make_optimizer
from osdp.schema.description import PHASES, Affine, UnitProfile, UnitWorkload
from osdp.schema.plan import ROOT, display_path


def _step(model: nn.Module, batch: Any, loss_fn, segments: Segments | None = None, after_forward=None) -> None:
    out = call_model(model, batch)
    loss = loss_of(out, loss_fn)
    del out
    if after_forward is not None:
        after_forward()
    if segments is None:
        loss.backward()
    else:
        segments.start("bwd")
        loss.backward()
        segments.close(ROOT)
    sparse = [name for name, p in model.named_parameters() if p.grad is not None and p.grad.layout != torch.strided]
    if sparse:
        raise ProfileError(sparse_gradients_message(", ".join(sparse)))


def _checked_forward(model: nn.Module, units: Sequence[Unit] | None, batch: Any, loss_fn) -> Any:
    """A forward (no grad) that, if it fails, names the innermost unit and module running; its output."""
    modules: list[str] = []
    handles = []

    def enter(path: str) -> None:
        modules.append(path)

    def leave(*_: Any) -> None:
        modules.pop()

    for path, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda *_, p=path: enter(p)))
        handles.append(m.register_forward_hook(leave))
    try:
        with without_grad():
            output = call_model(model, batch)
            loss_of(output, loss_fn)
            return output
    except ProfileError:
        raise
    except Exception as e:
        unit_paths = {u.path for u in units} if units is not None else None
        inner = modules[-1] if modules else ROOT
        unit = next((p for p in reversed(modules) if unit_paths is None or p in unit_paths), ROOT)
        if unit_paths is None:  # units not discovered yet: the innermost default unit candidate
            unit = _innermost_default_unit(model, modules)
        where = f"unit '{display_path(unit)}'"
        if inner != unit:
            where += f" (module '{display_path(inner)}', {type(model.get_submodule(inner)).__name__})"
        hint = ""
        if type(e).__name__ in ("DynamicOutputShapeException", "DataDependentOutputException"):
            hint = (" (the forward depends on the values of the data, as routing to experts does, which the analytic "
                    "describe's fake tensors do not have: describe it measured, on the device)")
        raise ProfileError(f"the forward of the example batch failed in {where}: {type(e).__name__}: {e}{hint}") from e
    finally:
        for h in handles:
            h.remove()


def _innermost_default_unit(model: nn.Module, running: list[str]) -> str:
    paths = {u.path for u in discover_units(model)}
    return next((p for p in reversed(running) if p in paths), ROOT)


def _check_units(model: nn.Module, units: Sequence[Unit], calls: CallTrace) -> None:
    counts = calls.counts
    for u in units:
        if u.path != ROOT and u.numel == 0:
            raise ProfileError(
                f"unit '{u.name}' owns no parameters (they all belong to units nested in it, or it has "
                "none): a unit is a module whose parameters are sharded together; remove it"
            )
        if counts.get(u.path, 0) > 1:
            raise ProfileError(
                f"unit '{u.name}' runs {counts[u.path]} times per forward; FSDP would gather it each "
                "time and its activations add up: make its parent the unit (osdp.discover_units does "
                "this by itself when given call counts)"
            )
        container = enclosing(u.path, [*routed_containers(model, calls), *calls.uneven])
        if u.path != ROOT and container is not None:
            raise ProfileError(
                f"unit '{u.name}' is called or not depending on the data ('{display_path(container)}' ran a "
                "different number of times on each rank's example, or its members ran on different rows, or some "
                "not at all, as a mixture of experts routes them): a rank whose batch skips it would wait for the "
                "others at another gather; make the module calling it the unit (osdp.discover_units does this by "
                "itself)"
            )
        if u.path != ROOT and u.path in calls.writes_inputs:
            raise ProfileError(
                f"unit '{u.name}' writes to its input in place (an in-place op such as nn.ReLU(inplace=True) "
                "first in its forward): FSDP2 hands a unit its inputs as views that autograd does not let a "
                "forward write to; make its parent the unit (osdp.discover_units does this by itself) or the "
                "op out of place"
            )


def resolve_units(
    model: nn.Module, batch: Any, loss_fn, units: Sequence[Unit] | None, granularity: str = "sub-block",
    uneven: Sequence[str] = (),
) -> tuple[list[Unit], tuple[str, ...], int]:
    """The units to describe, after a checked forward that names the unit that fails, if one does; the
    modules called depending on the data: containers whose members that forward called so
    (``routed_containers``), and ``uneven``, the modules the ranks' examples called unevenly
    (``osdp.describe.units.uneven_calls``); and the bytes of the forward's output (``held_output_bytes``).

    Default units come from ``osdp.discover_units`` at ``granularity`` with
    call counts, so a module that runs twice per forward is merged into its
    parent; given units that run twice, own no parameters or are called depending on the data are refused.
    """
    outputs: list[Any] = []
    calls = trace_calls(model, lambda: outputs.append(_checked_forward(model, units, batch, loss_fn)))
    # looked at after the trace, which would take reading the parameters' storages for uses of them
    held = held_output_bytes(outputs.pop(), list(model.parameters()), list(model.buffers()), batch)
    if not calls.uses:
        raise ProfileError(
            "the forward of the example batch used none of the model's parameters: there is nothing to train or "
            "to shard; check that the example reaches the model's layers (and loss_fn its output)"
        )
    calls.uneven = tuple(uneven)
    routed = tuple(dict.fromkeys([*routed_containers(model, calls), *calls.uneven]))
    if units is None:
        return discover_units(model, calls, granularity), routed, held
    units = build_units(model, [u.path for u in units])
    _check_units(model, units, calls)
    return units, routed, held


def _median_by_key(runs: list[dict]) -> dict:
    keys = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def memory_pass(
    model: nn.Module, units: Sequence[Unit], batch: Any, loss_fn, also: Callable[[str, str], None] | None = None,
    recomputed: bool = True, routed: Sequence[str] = (),
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """One forward and backward under ``osdp.machine.memory.LiveBytesTracker``: per unit its saved bytes
    (act, ckpt) and working-set peaks (see ``_working_sets``), and the units' forward order; with
    ``recomputed``, then one with every checkpointable unit checkpointed, whose backward working sets bound the
    recomputed ones (``_recomputed_working_sets``).

    ``also(owner, phase)`` is called at every segment boundary of the first pass (the analytic
    description counts FLOPs there). ``routed``: the routed containers; the members of one the example did not
    call are priced as their siblings that ran (``UnrunMembers``), in the saved bytes and the working sets of the
    unit holding it. Works on real and on fake tensors.
    """
    memory, segments_seen, root_total, segments = _segments_pass(model, units, batch, loss_fn, also, routed)
    _working_sets(memory, segments_seen, root_total)
    for m in memory.values():
        for key in ("fwd_peak", "bwd_peak", "recompute_peak", "bwd_head", "bwd_between", "bwd_tail"):
            if key in m:  # the root's backward by where it runs: the root only
                m[key] += m.get("unrun", 0)
    for path in segments.run_in_backward:  # UnitWorkload.run_in_backward
        memory[path]["run_in_backward"] = 1
    for path in segments.reduced_at_end:  # UnitWorkload.reduced_at_end
        memory[path]["reduced_at_end"] = 1
    takers = may_checkpoint(units, memory, "full")
    if recomputed and takers:
        with _checkpointed(model, takers, "full"):
            _, checkpointed_segments, root_total, _ = _segments_pass(model, units, batch, loss_fn)
        _recomputed_working_sets(memory, checkpointed_segments, root_total, [u.path for u in takers])
    return memory, list(segments.finished)


def may_checkpoint(units: Sequence[Unit], memory: Mapping[str, Mapping[str, int]], policy: str) -> list[Unit]:
    """The units a plan may checkpoint with ``policy`` ("full", "selective"), by a memory pass's ``memory``: a
    unit whose inputs the forward writes in place takes none, one whose kept outputs it writes no selective."""
    return [u for u in checkpointable(units) if not memory[u.path].get("no_checkpoint")
            and (policy == "full" or "sac" in memory[u.path])]


def _recomputed_working_sets(
    memory: dict[str, dict[str, int]], segments: Sequence[tuple[str, str, int, int, int, int]], root_total: int,
    paths: Sequence[str],
) -> None:
    """Each checkpointable unit's recomputed working set: at least its backward's, measured with every such unit
    checkpointed, net of the root's absent bytes as ``_working_sets`` counts them. The plain pass's larger of its
    forward and backward can miss what only a recompute holds: at the contract tests' sizes an LSTM's, a GRU's
    and PyTorch's MultiheadAttention's checkpointed backward held one output's bytes more (8 KiB), and a plan
    checkpointing the LSTM measured 7 KiB over its predicted peak; a GPT block's held no more."""
    peaks: dict[str, int] = {}
    credit: dict[str, int] = {}
    for phase, owner, working, root_live, _, _ in segments:
        if phase == "bwd" and owner in paths:
            peaks[owner] = max(peaks.get(owner, working), working)
            credit[owner] = min(credit.get(owner, root_total - root_live), root_total - root_live)
    for path, peak in peaks.items():
        memory[path]["recompute_peak"] = max(memory[path]["recompute_peak"], peak - credit[path])


def _keeping_graphs(model: nn.Module, units: Sequence[Unit]) -> set[str]:
    """The units whose modules keep, after the forward, a tensor it computed with grad as a plain attribute (an
    auxiliary loss on ``self.aux_loss``, an attention map kept for display), and the units inside them: its graph
    holds a checkpoint's inputs past the unit's backward, until the next forward replaces it."""
    paths = [u.path for u in units]
    holders = {holding_unit(name, paths) for name, m in model.named_modules()
               if any(t.grad_fn is not None for k, v in vars(m).items() if not k.startswith("_")
                      for t in iter_tensors(v))}
    return {p for p in paths for h in holders if p == h or p.startswith(h + ".") or h == ROOT}


def _checkpoint_memory(memory: dict[str, dict[str, int]], units: Sequence[Unit], writes: InPlaceWrites,
                       kept_by_selective: KeptBySelective, saved: _Saved, keeping: set[str]) -> None:
    """Per checkpointable unit, after the forward: whether a checkpoint may take it at all, what selective
    checkpointing keeps (the inputs and SAVED_OPS' outputs) and the FLOPs each policy's recompute redoes."""
    for u in checkpointable(units):
        if u.path in writes.inputs_written or u.path in writes.state_written or u.path in keeping:
            memory[u.path]["no_checkpoint"] = 1
        elif u.path not in writes.kept_written:  # else offered none or full only
            memory[u.path]["sac"] = (memory[u.path]["ckpt"] + kept_by_selective.bytes.get(u.path, 0)
                                     + memory[u.path].get("unrun", 0))
            memory[u.path]["sac_unsaved"] = kept_by_selective.unsaved_bytes(u.path, saved.first_saver)
        for policy, redone in kept_by_selective.recompute_flops.items():
            memory[u.path][f"{policy}_recompute_flops"] = redone.get(u.path, 0)


def _segments_pass(
    model: nn.Module, units: Sequence[Unit], batch: Any, loss_fn, also: Callable[[str, str], None] | None = None,
    routed: Sequence[str] = (),
) -> tuple[dict[str, dict[str, int]], list[tuple[str, str, int, int, int, int]], int, Segments]:
    """One forward and backward under ``LiveBytesTracker``, cut into the units' segments: per unit its saved
    bytes, every segment's working set, the root's saved bytes after the forward, and the segments (the units'
    forward order, those the model's own reentrant checkpoint ran again in backward)."""
    model.zero_grad(set_to_none=True)
    # a parameter or buffer a forward saves is no activation: it lives all step (a buffer is priced as such,
    # ModelDescription.buffer_bytes), and the tracker counts it apart from the working sets
    state_keys = state_storage_keys(model)
    # per segment: phase, owner, the owner's saved bytes plus temporaries at the segment's peak, root saved live
    segments_seen: list[tuple[str, str, int, int, int, int]] = []
    pending: dict[str, list[nn.Parameter]] = {}  # gradients of a unit whose backward is running
    memory: dict[str, dict[str, int]] = {}
    last_root = root_total = 0
    # PyTorch's memory trackers (FSDPMemTracker, MemTracker) run a module tracker, whose hooks hold the gradients of a
    # module's inputs until all of them are computed: the peak they report is the peak under those hooks, so the
    # working sets are measured under them too (without them a GRU decoder's plan measured over its budget)
    with LiveBytesTracker(model, *iter_tensors(batch)) as tracker, module_tracker():

        def on_close(owner: str, phase: str) -> None:
            nonlocal last_root
            # A unit's gradients are temporaries while its backward runs (FSDP reduces and frees
            # them right after), gradients from then on; the enclosing units' (the root's) stay
            # temporaries, as FSDP keeps them unsharded to the end of backward.
            for unit in [w for w in pending if w != owner]:
                for p in pending.pop(unit):
                    tracker.mark(p.grad, "gradients")
            peak, now = tracker.peak_breakdown(), tracker.current_breakdown()
            others = saved.total_live - saved.live.get(owner, 0)  # other units' saved bytes do not change here
            working = peak["temporaries"] + peak["activations"] - others
            working_now = now["temporaries"] + now["activations"] - others
            root = saved.live.get(ROOT, 0)
            # the root's saved bytes during the segment: at its end in forward, its start in backward
            segments_seen.append((phase, owner, working, max(last_root, root), working_now, root))
            last_root = root
            tracker.reset_peak()
            if also is not None:
                also(owner, phase)

        segments = Segments(model, units, on_close)
        linear_rows = LinearRows(model, segments)
        kept_by_selective = KeptBySelective(segments)
        writes = InPlaceWrites(segments, kept_by_selective)

        def on_saved(t: torch.Tensor) -> None:
            tracker.mark(t, "activations")
            kept_by_selective.saved()

        saved = _Saved(segments, state_keys, chain=on_saved)
        unrun = UnrunMembers(model, routed, units, saved)
        enclosing = {u.path for u in units if u.nested or u.path == ROOT}
        grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda p, home=home: pending.setdefault(home, []).append(p))
            for p in model.parameters()
            if p.requires_grad and (home := segments.homes[id(p)]) not in enclosing
        ]

        def after_forward() -> None:
            nonlocal root_total
            memory.update(saved.per_unit(u.path for u in units))
            for holder, extra in unrun.extra().items():
                memory[holder]["act"] += extra
                memory[holder]["unrun"] = extra
            root_total = saved.live.get(ROOT, 0)
            for path, rows in linear_rows.rows.items():  # UnitWorkload.split_rows
                memory.setdefault(path, {})["split_rows"] = rows
            _checkpoint_memory(memory, units, writes, kept_by_selective, saved, _keeping_graphs(model, units))

        try:
            with segments, linear_rows, unrun, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                    kept_by_selective, writes:
                _step(model, batch, loss_fn, segments, after_forward)
        finally:
            for h in grad_hooks:
                h.remove()
            saved.close()
    model.zero_grad(set_to_none=True)
    return memory, segments_seen, root_total, segments


_REMEASURES = 3


def _time_at(
    model: nn.Module,
    units: Sequence[Unit],
    batch: Any,
    loss_fn,
    repeats: int,
    sync: Callable[[], None],
    policies: Mapping[str, Sequence[Unit]] = {},
) -> dict[str, Any]:
    """Per-unit seconds (medians over ``repeats`` hooked steps), scaled so that they add up to the
    median plain step (hooks cost a few percent, waiting for a GPU at every boundary more; plain
    and hooked steps alternate). For each checkpoint policy in ``policies`` ("full", "selective": the units
    that can take it), also those units' recompute seconds under it ("recompute_seconds"[policy]): how much
    longer a step takes with it checkpointed. How much that is in all comes from whole unhooked steps, all
    those units checkpointed against none, and how it divides among units from the differences of their hooked
    backward segments (a unit whose backward needs little of its forward recomputes little). Each
    checkpointed step follows a plain one, so a machine that speeds up or slows down while we measure moves both
    sides of a difference alike."""
    timed: dict[str, list[dict]] = {p: [] for p in ("none", *policies)}
    plain: dict[str, list[float]] = {p: [] for p in ("none", *policies)}

    def measure_once() -> None:
        for policy in timed:
            with _checkpointed(model, policies[policy], policy) if policy != "none" else contextlib.nullcontext():
                model.zero_grad(set_to_none=True)
                timer = _Timer(sync)
                with Segments(model, units, timer) as segments:
                    sync()
                    timer.last = time.perf_counter()
                    _step(model, batch, loss_fn, segments)
                timed[policy].append(timer.seconds)
                model.zero_grad(set_to_none=True)
                with StepTimer(_device_of(model)) as step:
                    _step(model, batch, loss_fn)
                plain[policy].append(step.seconds)

    for _ in range(repeats):
        measure_once()
    # A fully checkpointed step, which runs the forward once more, is never faster than a plain one: where the
    # fastest of each says it is, the machine slowed down through every plain step (another process's burst):
    # measured again, a few times at most (a selective recompute may cost next to nothing: no such check)
    for _ in range(_REMEASURES):
        if "full" not in plain or min(plain["full"]) > min(plain["none"]):
            break
        measure_once()
    model.zero_grad(set_to_none=True)
    medians = _median_by_key(timed["none"])
    step_s = statistics.median(plain["none"])
    scale = step_s / sum(medians.values())
    out: dict[str, Any] = {
        "seconds": {k: v * scale for k, v in medians.items()},
        "step_s": step_s,
        "hooked_step_s": statistics.median(sum(t.values()) for t in timed["none"]),
        "recompute_seconds": {},
        "recompute_step_s": {},
    }
    for policy in policies:
        scale_ckpt = statistics.median(plain[policy]) / sum(_median_by_key(timed[policy]).values())
        shares = {
            u.path: statistics.median(
                max(0.0, c.get(("bwd", u.path), 0.0) * scale_ckpt - p.get(("bwd", u.path), 0.0) * scale)
                for p, c in zip(timed["none"], timed[policy])
            )
            for u in policies[policy]
        }
        # The segments alone over-count: checkpointing moves time across segment boundaries (gpt2-mini:
        # their sum was 1.3x the steps' difference with attention and MLP as units, 2x with whole blocks,
        # which made the search prefer the finer units for checkpointing when they are not faster).
        # The fastest of each: what interferes on a shared machine (another process, pages reclaimed and faulted
        # back) only ever adds time, in spikes up to several steps long that a median of two or three pairs'
        # differences takes in (0.6 of a full recompute measured for a selective one that redoes a ReLU).
        extra = max(0.0, min(plain[policy]) - min(plain["none"]))
        total = sum(shares.values())
        out["recompute_seconds"][policy] = {path: share * extra / total if total > 0 else 0.0
                                            for path, share in shares.items()}
        out["recompute_step_s"][policy] = extra
    return out


@contextlib.contextmanager
def _checkpointed(model: nn.Module, units: Sequence[Unit], policy: str = "full"):
    """``units`` checkpointed with ``policy`` as a plan checkpoints them (``osdp.describe.recompute``, forward
    caches off: ``osdp.describe.forward_caches``); restored on exit."""
    modules = dict(model.named_modules())
    wrapped = [modules[u.path] for u in units]
    for m in wrapped:
        checkpoint_unit(m, policy)
    no_cache = disable_caches_in_training(model, warn=False)
    try:
        yield
    finally:
        for m in wrapped:
            undo_checkpoint(m)
        for handle in no_cache:
            handle.remove()


@contextlib.contextmanager
def in_precision(model: nn.Module, units: Sequence[Unit], dtype: torch.dtype) -> Iterator[None]:
    """The model as FSDP's mixed precision runs it, in place, restored after: floating parameters and buffers in
    ``dtype`` (the same modules, so that a forward reaching one through a closure, as minGPT's ``mlpf`` lambda
    does, computes in it too), and every unit's floating inputs cast to ``dtype`` as FSDP2 casts them
    (``MixedPrecisionPolicy.cast_forward_inputs``: the root's images, a mask a forward builds in float)."""
    kept = [(t, t.data) for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]

    def cast(tree: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast(args), cast(kwargs)

    modules = dict(model.named_modules())
    hooks = [modules[u.path].register_forward_pre_hook(cast_inputs, with_kwargs=True) for u in units]
    try:
        with torch.no_grad():
            for t, data in kept:
                t.data = data.to(dtype)
        yield
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        for t, data in kept:
            t.data = data


def time_optimizers(params: Sequence[torch.Tensor], names: Iterable[str], repeats: int = 3) -> dict[str, float]:
    """Step seconds per fp32 parameter byte of each optimizer, on fresh tensors shaped like ``params``."""
    out = {}
    shapes = [tuple(p.shape) for p in params if p.requires_grad]
    device = next(iter(params)).device
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    for name in names:
        tensors = [nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
        for t in tensors:
            t.grad = torch.zeros_like(t)
        optimizer = make_optimizer(name, tensors)
        optimizer.step()  # creates the state
        times = []
        for _ in range(repeats):
            with StepTimer(device) as step:
                optimizer.step()
            times.append(step.seconds)
        out[name] = statistics.median(times) / nbytes
        del optimizer, tensors
    return out


def unit_profiles(model: nn.Module, units: Sequence[Unit], costs: Mapping[str, Mapping[str, UnitWorkload]],
                  routed: Sequence[str] = ()) -> list[UnitProfile]:
    """UnitProfiles from measured or analytic costs (precision -> path -> costs); the Linears of ``routed``
    containers are not split: a rank that skipped one would not join its slices' gathers."""
    from osdp.split import splittable_linears

    modules = dict(model.named_modules())
    homes = param_homes(model, [u.path for u in units])
    shapes: dict[str, list[tuple[int, ...]]] = {u.path: [] for u in units}
    for p in model.parameters():
        shapes[homes[id(p)]].append(tuple(p.shape))
    out = []
    for u in units:
        kept_whole = [modules[n] for n in (*u.nested, *routed)]
        linears = splittable_linears(modules[u.path], exclude=kept_whole, root=model) if u.path != ROOT else []
        out.append(
            UnitProfile(
                path=u.path,
                module_type=u.module_type,
                signature=u.signature,
                numel=u.numel,
                param_bytes=u.param_bytes,
                param_shapes=tuple(shapes[u.path]),
                split_shapes=tuple(tuple(lin.weight.shape) for _, lin in linears),
                nested=u.nested,
                costs={prec: by_path[u.path] for prec, by_path in costs.items()},
            )
        )
    return out


def average_repeated(units: Sequence[Unit], per_unit: Mapping[str, Mapping[str, float]], how: Callable) -> dict:
    """Per-unit measurements with every group of identical units (same signature) replaced by ``how`` of the group."""
    groups: dict[str, list[str]] = {}
    for u in units:
        groups.setdefault(u.signature if u.path != ROOT else "\0root", []).append(u.path)
    out = {}
    for paths in groups.values():
        keys = set().union(*(per_unit[p] for p in paths))
        merged = {k: how([per_unit[p].get(k, 0) for p in paths]) for k in keys}
        out.update({p: merged for p in paths})
    return out


def fit_costs(
    units: Sequence[Unit],
    sizes: Sequence[int],
    memory: Mapping[int, Mapping[str, Mapping[str, float]]],
    seconds: Mapping[int, Mapping[tuple[str, str], float]],
    flops: Mapping[int, Mapping[tuple[str, str], float]] | None = None,
    recompute_seconds: Mapping[str, Mapping[int, Mapping[str, float]]] | None = None,
) -> dict[str, UnitWorkload]:
    """UnitWorkload per unit from measurements at each size: times averaged over identical units,
    memory exact per unit (a unit's place in the schedule matters), all fitted linear in b.
    ``recompute_seconds``: per checkpoint policy and size, each checkpointable unit's recompute time."""
    paths = [u.path for u in units]

    def by_unit(table: Mapping[tuple[str, str], float]) -> dict[str, dict[str, float]]:
        return {p: {ph: table.get((ph, p), 0.0) for ph in PHASES} for p in paths}

    times = {b: average_repeated(units, by_unit(seconds[b]), statistics.fmean) for b in sizes}
    counts = {b: by_unit(flops[b]) for b in sizes} if flops is not None else None
    recompute: dict[str, dict[str, Affine]] = {}  # policy -> path -> seconds
    paired = checkpointable(units)
    for policy, at_size in (recompute_seconds or {}).items():
        per_size = {b: {u.path: {"s": at_size[b].get(u.path, 0.0)} for u in paired} for b in sizes}
        extra = {b: average_repeated(paired, per_size[b], statistics.fmean) for b in sizes}
        recompute[policy] = {u.path: Affine.fit(sizes, [extra[b][u.path]["s"] for b in sizes]) for u in paired}
    selective = {u.path for u in paired if all("sac" in memory[b][u.path] for b in sizes)}

    def fit(table: Mapping[int, Mapping[str, Mapping[str, float]]], path: str, key: str) -> Affine:
        return Affine.fit(sizes, [table[b][path].get(key, 0) for b in sizes])

    return {
        p: UnitWorkload(
            fwd_s=fit(times, p, "fwd"),
            bwd_s=fit(times, p, "bwd"),
            act_bytes=fit(memory, p, "act"),
            ckpt_bytes=fit(memory, p, "ckpt"),
            fwd_peak_bytes=fit(memory, p, "fwd_peak"),
            bwd_peak_bytes=fit(memory, p, "bwd_peak"),
            recompute_peak_bytes=fit(memory, p, "recompute_peak"),
            bwd_end_bytes=fit(memory, p, "bwd_end"),
            **({f"bwd_{part}_bytes": fit(memory, p, f"bwd_{part}") for part in ("head", "between", "tail")}
               if p == ROOT else {}),
            split_rows=fit(memory, p, "split_rows"),
            fwd_flops=fit(counts, p, "fwd") if counts else None,
            bwd_flops=fit(counts, p, "bwd") if counts else None,
            recompute_s=recompute.get("full", {}).get(p),
            sac_bytes=fit(memory, p, "sac") if p in selective and "selective" in recompute else None,
            sac_recompute_s=recompute.get("selective", {}).get(p),
            sac_unsaved_bytes=fit(memory, p, "sac_unsaved") if p in selective and "selective" in recompute else None,
            checkpointable=not any(memory[b][p].get("no_checkpoint") for b in sizes),
            run_in_backward=any(memory[b][p].get("run_in_backward") for b in sizes),
            reduced_at_end=all(memory[b][p].get("reduced_at_end") for b in sizes),
        )
        for p in paths
    }


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
