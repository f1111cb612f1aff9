"""Describe a model for the cost model: per unit, what it stores and how long it computes.

``describe(model, example_input)`` runs forward and backward on the device the
job runs on and measures, for every unit (``osdp.units``):

* parameter shapes (exact; they give FSDP's padding, bytes and the split Linears);
* activation bytes saved for backward: saved-tensor hooks attribute each saved
  storage to the innermost unit running when autograd saves it (module hooks
  keep a stack), counted once however many views share it, parameters left out;
  and what checkpointing keeps instead (the unit's inputs);
* working sets: the peak of the unit's own live saved bytes plus all
  temporaries (logits on their way into the loss, gradients in flight) while
  its forward or backward runs, and when its backward ends, measured with
  ``osdp.memory.LiveBytesTracker`` (``_working_sets`` says exactly what);
* forward and backward compute time, timed per unit with the same attribution.

Everything is measured at a few micro-batch sizes and fitted linear in the
size. Units with the same ``signature`` (repeated blocks) get the average of
their times; memory stays per unit, because where a unit runs in the schedule
matters. The optimizer's step time per parameter byte is measured too. The
result is cached on disk (``OSDP_CACHE_DIR``, default ``~/.cache/osdp``), keyed
by everything that changes it, so a second ``describe`` of the same model is
instant.

Attribution. Forward: a segment of time (or memory peak) between two hook
events belongs to the innermost unit whose forward is running; time outside
every unit (the loss of a model returning logits) is the root's. Backward, where
module hooks cannot say when a unit is done: a segment belongs to the unit the
event that closes it names, because that event fires right after the op that
produced it: the arrival of a unit's output gradient closes a segment of the
unit around it, the gradient of a unit's input or of one of its parameters
closes a segment of that unit. Every second is attributed to exactly one unit,
so the units add up to the timed step (``ModelDescription.checks`` records both).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import statistics
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from osdp.caches import disable_caches_in_training
from osdp.description import PHASES, PRECISIONS, Affine, ModelDescription, UnitProfile, UnitWorkload
from osdp.log import Progress
from osdp.machine import device_name
from osdp.memory import LiveBytesTracker, iter_tensors, map_tensors
from osdp.optim import make_optimizer
from osdp.plan import ROOT, display_path
from osdp.recompute import checkpoint_unit, undo_checkpoint
from osdp.timing import StepTimer
from osdp.store import write_atomically
from osdp.units import Unit, build_units, discover_units, param_homes, structure_signature, trace_calls

PROFILE_VERSION = 5  # bump when what is measured changes: old cache entries are ignored


class ProfileError(ValueError):
    """The model cannot be described as given (the message names the unit)."""


# --------------------------------------------------------------------------- batches


def batch_size_of(example_input: Any) -> int:
    """The batch size: dim 0 of the example's tensors (which must agree)."""
    sizes = {t.shape[0] for t in iter_tensors(example_input) if t.dim() >= 1}
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"batch dimensions {sorted(sizes)}"
        raise ProfileError(
            f"example_input must hold tensors with one batch size in dim 0 (a tensor, a tuple of "
            f"positional arguments or a dict of keyword arguments); found {found}"
        )
    return sizes.pop()


def resize_batch(example_input: Any, b: int) -> Any:
    """The example with ``b`` samples: its first b rows, or its rows repeated."""
    n = batch_size_of(example_input)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        if b <= n:
            return t[:b].clone(memory_format=torch.contiguous_format)  # its own storage: saved bytes are its bytes
        reps = [math.ceil(b / n)] + [1] * (t.dim() - 1)
        return t.repeat(*reps)[:b].contiguous()

    return map_tensors(resize, example_input)


def input_spec(example_input: Any) -> str:
    """Per-sample shapes and dtypes of the example: part of the cache key."""

    def spec(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return f"{str(obj.dtype).removeprefix('torch.')}{list(obj.shape[1:])}"
        if isinstance(obj, (list, tuple)):
            return [spec(x) for x in obj]
        if isinstance(obj, Mapping):
            return {str(k): spec(v) for k, v in obj.items()}
        return repr(obj)

    return json.dumps(spec(example_input), sort_keys=True)


def input_bytes_per_sample(example_input: Any) -> float:
    """Bytes of the example's storages (each once, however many views share it) per sample."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in iter_tensors(example_input)}
    return sum(storages.values()) / batch_size_of(example_input)


def call_model(model: nn.Module, example_input: Any) -> Any:
    """A tensor is one argument, a tuple or list positional arguments, a dict keyword arguments."""
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    return model(example_input)


def loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """The scalar to call backward on: ``loss_fn(output)``, or the output when it is a loss."""
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProfileError(
            "the model's output is not a scalar loss; pass loss_fn=... (called on the output, "
            "returning a scalar tensor)"
        )
    return loss


# --------------------------------------------------------------------------- attribution


class Segments:
    """Cuts a forward and backward into segments, each owned by one unit, and reports them.

    ``on_close(owner, phase)`` is called at every boundary for the segment that
    ends there (see the module docstring for the rules). ``stack`` is the
    forward's unit stack: after an exception in forward, its top is the unit
    that failed.
    """

    def __init__(self, model: nn.Module, units: Sequence[Unit], on_close: Callable[[str, str], None]):
        self.model, self.units, self.on_close = model, units, on_close
        self.modules = dict(model.named_modules())
        self.parent = {n: u.path for u in units for n in u.nested}
        self.homes = param_homes(model, [u.path for u in units])
        self.stack: list[str] = []
        self.phase = "fwd"
        self.inputs: dict[str, list[tuple[int, int, Any]]] = {}  # unit -> (storage key, bytes, weakref) of its inputs
        self.finished: list[str] = []  # units in the order their forward ended (FSDP2's post-forward order)
        self._handles: list[Any] = []

    def close(self, owner: str) -> None:
        self.on_close(owner, self.phase)

    def start(self, phase: str) -> None:
        """Close what ran before (outside every unit: the root's) and enter ``phase``."""
        self.close(ROOT)
        self.phase = phase

    def __enter__(self) -> "Segments":
        for u in self.units:
            m = self.modules[u.path]
            self._handles.append(m.register_forward_pre_hook(self._pre(u.path), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(u.path)))
            if u.path != ROOT:
                parent = self.parent.get(u.path, ROOT)
                self._handles.append(m.register_full_backward_pre_hook(lambda *_, o=parent: self.close(o)))
                self._handles.append(m.register_full_backward_hook(lambda *_, o=u.path: self.close(o)))
        for p in self.model.parameters():
            if p.requires_grad:
                home = self.homes[id(p)]
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _, o=home: self.close(o)))
        self.stack.clear()
        self.phase = "fwd"
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, path: str):
        def hook(_module, args, kwargs):
            self.close(self.stack[-1] if self.stack else ROOT)
            self.stack.append(path)
            self.inputs[path] = [
                (_storage_key(t), t.untyped_storage().nbytes(), weakref.ref(t.untyped_storage()))
                for t in iter_tensors((args, kwargs))
                if t.layout == torch.strided
            ]

        return hook

    def _post(self, path: str):
        def hook(_module, _args, _output):
            self.close(path)
            self.stack.pop()
            if path not in self.finished:
                self.finished.append(path)

        return hook


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work: on CUDA a clock read without it times the kernel launches."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


class _Timer:
    """Seconds per (phase, unit) between segment boundaries (``sync`` first waits for the device)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.seconds: dict[tuple[str, str], float] = {}
        self.sync = sync
        self.last = time.perf_counter()

    def __call__(self, owner: str, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        key = (phase, owner)
        self.seconds[key] = self.seconds.get(key, 0.0) + now - self.last
        self.last = now


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Saved:
    """Saved-tensor attribution: each storage counted once, for the first unit that saves it.

    Follows how many saved bytes of each unit are alive (``live``), so that a
    memory peak can be split into the running unit's own saved bytes and the
    rest.
    """

    def __init__(self, segments: Segments, param_keys: set[int], chain: Callable[[torch.Tensor], Any] | None):
        self.segments, self.param_keys, self.chain = segments, param_keys, chain
        self.first_saver: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}
        self.live: dict[str, int] = {}
        self.total_live = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.chain is not None:
            self.chain(t)
        if self.segments.phase == "fwd" and t.layout == torch.strided:
            key = _storage_key(t)
            if key not in self.param_keys and key not in self.first_saver:
                owner = self.segments.stack[-1] if self.segments.stack else ROOT
                nbytes = t.untyped_storage().nbytes()
                self.first_saver[key] = owner
                self.nbytes[key] = nbytes
                self.live[owner] = self.live.get(owner, 0) + nbytes
                self.total_live += nbytes
                weakref.finalize(t.untyped_storage(), self._freed, owner, nbytes)
        return t

    def _freed(self, owner: str, nbytes: int) -> None:
        self.live[owner] -= nbytes
        self.total_live -= nbytes

    def per_unit(self, paths: Iterable[str]) -> dict[str, dict[str, int]]:
        """act and ckpt bytes per unit (see UnitWorkload). Call it between forward and backward.

        A checkpointed unit keeps its inputs alive: those it saves itself, and
        those nobody saves (dead by now); inputs kept alive by the caller (the
        batch) cost nothing extra. An input another unit saved (T5's position
        bias, a decoder's encoder memory) is that unit's while it saves its
        activations, but only a checkpoint keeps it once that unit is
        checkpointed too (the root and units enclosing others never are): the
        first unit that takes it as input counts it, so
        that a plan checkpointing both stays within its prediction (one that
        checkpoints only the borrower is over-predicted by those bytes).
        """
        out = {p: {"act": 0, "ckpt": 0} for p in paths}
        for key, owner in self.first_saver.items():
            out[owner]["act"] += self.nbytes[key]
        lenders = {u.path for u in checkpointable(self.segments.units)}  # the root and enclosing units never are
        borrowed: set[int] = set()
        for path, inputs in self.segments.inputs.items():  # in forward order
            alive = {k: n for k, n, ref in inputs if ref() is not None and k not in self.param_keys}
            dead = {k: n for k, n, ref in inputs if ref() is None}
            own = sum(n for k, n in alive.items() if self.first_saver.get(k) == path)
            lent = {k: n for k, n in alive.items()
                    if self.first_saver.get(k) in lenders and self.first_saver.get(k) != path and k not in borrowed}
            borrowed.update(lent)
            out[path]["ckpt"] = own + sum(dead.values()) + sum(lent.values())
        return out


def _working_sets(
    memory: dict[str, dict[str, int]], segments: Sequence[tuple[str, str, int, int, int, int]], root_total: int
) -> None:
    """Per unit, the peaks of its working set in forward, backward, and when recomputed in backward,
    and the working set when its backward ends (where FSDP reduces its gradients).

    A working set is the unit's own live saved bytes plus all temporaries at
    the peak of one of its segments. For a unit other than the root, the
    root's saved bytes that do not exist at that moment (not saved yet in
    forward, freed in backward) are subtracted: the cost model counts all of
    the root's activations, whatever else it counts; the root is never
    checkpointed, so this holds for every plan. A checkpointed unit redoes its
    forward at the start of its backward, so its recomputed working set is
    the larger of the two, at the backward's moment.
    """
    net: dict[tuple[str, str], int] = {}  # (phase, unit) -> largest working set net of the root's absent bytes
    raw: dict[tuple[str, str], int] = {}
    credit_bwd: dict[str, int] = {}  # the smallest such credit while the unit's backward runs
    end: dict[str, int] = {}
    for phase, owner, working, root_live, working_now, root_now in segments:
        credit = 0 if owner == ROOT else root_total - root_live
        key = (phase, owner)
        net[key] = max(net.get(key, working - credit), working - credit)
        raw[key] = max(raw.get(key, working), working)
        if phase == "bwd":
            credit_bwd[owner] = min(credit_bwd.get(owner, credit), credit)
            end[owner] = working_now - (0 if owner == ROOT else root_total - root_now)  # the last one stays
    for path, m in memory.items():
        m["fwd_peak"] = net.get(("fwd", path), 0)
        m["bwd_peak"] = net.get(("bwd", path), 0)
        both = max(raw.get(("fwd", path), 0), raw.get(("bwd", path), 0))
        m["recompute_peak"] = both - credit_bwd.get(path, 0)
        m["bwd_end"] = end.get(path, 0)



# --------------------------------------------------------------------------- measuring


def _step(model: nn.Module, batch: Any, loss_fn, segments: Segments | None = None, after_forward=None) -> None:
    out = call_model(model, batch)
    loss = loss_of(out, loss_fn)
    del out
    if after_forward is not None:
        after_forward()
    if segments is None:
        loss.backward()
        return
    segments.start("bwd")
    with warnings.catch_warnings():  # units whose inputs need no gradient (embeddings): expected, see Segments
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    segments.close(ROOT)


def _checked_forward(model: nn.Module, units: Sequence[Unit] | None, batch: Any, loss_fn) -> None:
    """A forward (no grad) that, if it fails, names the innermost unit and module running."""
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
        with torch.no_grad():
            loss_of(call_model(model, batch), loss_fn)
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
        raise ProfileError(f"the forward of the example batch failed in {where}: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()


def _innermost_default_unit(model: nn.Module, running: list[str]) -> str:
    paths = {u.path for u in discover_units(model)}
    return next((p for p in reversed(running) if p in paths), ROOT)


def _check_units(model: nn.Module, units: Sequence[Unit], counts: Mapping[str, int]) -> None:
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


def resolve_units(
    model: nn.Module, batch: Any, loss_fn, units: Sequence[Unit] | None, granularity: str = "sub-block"
) -> list[Unit]:
    """The units to describe, after a checked forward that names the unit that fails, if one does.

    Default units come from ``osdp.discover_units`` at ``granularity`` with
    call counts, so a module that runs twice per forward is merged into its
    parent; given units that run twice or own no parameters are refused.
    """
    calls = trace_calls(model, lambda: _checked_forward(model, units, batch, loss_fn))
    if not calls.uses:
        raise ProfileError(
            "the forward of the example batch used none of the model's parameters: there is nothing to train or "
            "to shard; check that the example reaches the model's layers (and loss_fn its output)"
        )
    if units is None:
        return discover_units(model, calls, granularity)
    units = build_units(model, [u.path for u in units])
    _check_units(model, units, calls.counts)
    return units


def _median_by_key(runs: list[dict]) -> dict:
    keys = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def memory_pass(
    model: nn.Module, units: Sequence[Unit], batch: Any, loss_fn, also: Callable[[str, str], None] | None = None
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """One forward and backward under ``osdp.memory.LiveBytesTracker``: per unit its saved bytes
    (act, ckpt) and working-set peaks (see ``_working_sets``), and the units' forward order.

    ``also(owner, phase)`` is called at every segment boundary too (the analytic
    description counts FLOPs there). Works on real and on fake tensors.
    """
    model.zero_grad(set_to_none=True)
    param_keys = {_storage_key(p) for p in model.parameters()}
    # per segment: phase, owner, the owner's saved bytes plus temporaries at the segment's peak, root saved live
    segments_seen: list[tuple[str, str, int, int, int, int]] = []
    pending: dict[str, list[nn.Parameter]] = {}  # gradients of a unit whose backward is running
    memory: dict[str, dict[str, int]] = {}
    last_root = root_total = 0
    with LiveBytesTracker(model, *iter_tensors(batch)) as tracker:

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
        saved = _Saved(segments, param_keys, chain=lambda t: tracker.mark(t, "activations"))
        enclosing = {u.path for u in units if u.nested or u.path == ROOT}
        grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda p, home=home: pending.setdefault(home, []).append(p))
            for p in model.parameters()
            if p.requires_grad and (home := segments.homes[id(p)]) not in enclosing
        ]

        def after_forward() -> None:
            nonlocal root_total
            memory.update(saved.per_unit(u.path for u in units))
            root_total = saved.live.get(ROOT, 0)

        try:
            with segments, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                _step(model, batch, loss_fn, segments, after_forward)
        finally:
            for h in grad_hooks:
                h.remove()
    model.zero_grad(set_to_none=True)
    _working_sets(memory, segments_seen, root_total)
    return memory, list(segments.finished)


def _time_at(
    model: nn.Module,
    units: Sequence[Unit],
    batch: Any,
    loss_fn,
    repeats: int,
    sync: Callable[[], None],
    checkpointed: bool = False,
) -> dict[str, Any]:
    """Per-unit seconds (medians over ``repeats`` hooked steps), scaled so that they add up to the
    median plain step (hooks cost a few percent, waiting for a GPU at every boundary more; plain
    and hooked steps alternate). With ``checkpointed``, also each checkpointable unit's recompute
    seconds ("recompute_seconds"): how much longer a step takes with it checkpointed. How much that is
    in all comes from whole unhooked steps, every unit checkpointed against none, and how it divides
    among units from the differences of their hooked backward segments (a unit whose backward needs
    little of its forward recomputes little). Each checkpointed step follows a plain one and both
    are medians of the pairs' differences, so a machine that speeds up or slows down while we
    measure moves both sides of a difference alike."""
    timed: dict[bool, list[dict]] = {False: [], True: []}
    plain: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for ckpt in (False, True) if checkpointed else (False,):
            with _checkpointed(model, units) if ckpt else contextlib.nullcontext():
                model.zero_grad(set_to_none=True)
                timer = _Timer(sync)
                with Segments(model, units, timer) as segments:
                    sync()
                    timer.last = time.perf_counter()
                    _step(model, batch, loss_fn, segments)
                timed[ckpt].append(timer.seconds)
                model.zero_grad(set_to_none=True)
                with StepTimer(_device_of(model)) as step:
                    _step(model, batch, loss_fn)
                plain[ckpt].append(step.seconds)
    model.zero_grad(set_to_none=True)
    medians = _median_by_key(timed[False])
    step_s = statistics.median(plain[False])
    scale = step_s / sum(medians.values())
    out = {
        "seconds": {k: v * scale for k, v in medians.items()},
        "step_s": step_s,
        "hooked_step_s": statistics.median(sum(t.values()) for t in timed[False]),
    }
    if checkpointed:
        scale_ckpt = statistics.median(plain[True]) / sum(_median_by_key(timed[True]).values())
        shares = {
            u.path: statistics.median(
                max(0.0, c.get(("bwd", u.path), 0.0) * scale_ckpt - p.get(("bwd", u.path), 0.0) * scale)
                for p, c in zip(timed[False], timed[True])
            )
            for u in checkpointable(units)
        }
        # The segments alone over-count: checkpointing moves time across segment boundaries (gpt2-mini:
        # their sum was 1.3x the steps' difference with attention and MLP as units, 2x with whole blocks,
        # which made the search prefer the finer units for checkpointing when they are not faster).
        extra = max(0.0, statistics.median(c - p for p, c in zip(plain[False], plain[True])))
        total = sum(shares.values())
        out["recompute_seconds"] = {path: share * extra / total if total > 0 else 0.0
                                    for path, share in shares.items()}
        out["recompute_step_s"] = extra
    return out


def checkpointable(units: Sequence[Unit]) -> list[Unit]:
    """The units a plan may checkpoint: not the root, none enclosing other units."""
    return [u for u in units if u.path != ROOT and not u.nested]


@contextlib.contextmanager
def _checkpointed(model: nn.Module, units: Sequence[Unit]):
    """Every checkpointable unit checkpointed as a plan checkpoints it (``osdp.recompute``, forward caches
    off: ``osdp.caches``); restored on exit."""
    modules = dict(model.named_modules())
    wrapped = [modules[u.path] for u in checkpointable(units)]
    for m in wrapped:
        checkpoint_unit(m)
    no_cache = disable_caches_in_training(model, warn=False)
    try:
        yield
    finally:
        for m in wrapped:
            undo_checkpoint(m)
        for handle in no_cache:
            handle.remove()


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


def unit_profiles(model: nn.Module, units: Sequence[Unit], costs: Mapping[str, Mapping[str, UnitWorkload]]) -> list[UnitProfile]:
    """UnitProfiles from measured or analytic costs (precision -> path -> costs)."""
    from osdp.split import splittable_linears

    modules = dict(model.named_modules())
    homes = param_homes(model, [u.path for u in units])
    shapes: dict[str, list[tuple[int, ...]]] = {u.path: [] for u in units}
    for p in model.parameters():
        shapes[homes[id(p)]].append(tuple(p.shape))
    out = []
    for u in units:
        nested = [modules[n] for n in u.nested]
        linears = splittable_linears(modules[u.path], exclude=nested, root=model) if u.path != ROOT else []
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
    recompute_seconds: Mapping[int, Mapping[str, float]] | None = None,
) -> dict[str, UnitWorkload]:
    """UnitWorkload per unit from measurements at each size: times averaged over identical units,
    memory exact per unit (a unit's place in the schedule matters), all fitted linear in b.
    ``recompute_seconds``: per size, each checkpointable unit's measured recompute time."""
    paths = [u.path for u in units]

    def by_unit(table: Mapping[tuple[str, str], float]) -> dict[str, dict[str, float]]:
        return {p: {ph: table.get((ph, p), 0.0) for ph in PHASES} for p in paths}

    times = {b: average_repeated(units, by_unit(seconds[b]), statistics.fmean) for b in sizes}
    counts = {b: by_unit(flops[b]) for b in sizes} if flops is not None else None
    recompute: dict[str, Affine] = {}
    if recompute_seconds is not None:
        paired = checkpointable(units)
        per_size = {b: {p: {"s": s} for p, s in recompute_seconds[b].items()} for b in sizes}
        extra = {b: average_repeated(paired, per_size[b], statistics.fmean) for b in sizes}
        for u in paired:
            recompute[u.path] = Affine.fit(sizes, [extra[b][u.path]["s"] for b in sizes])

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
            fwd_flops=fit(counts, p, "fwd") if counts else None,
            bwd_flops=fit(counts, p, "bwd") if counts else None,
            recompute_s=recompute.get(p),
        )
        for p in paths
    }


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    return Path(os.environ.get("OSDP_CACHE_DIR") or Path.home() / ".cache" / "osdp")


def model_fingerprint(model: nn.Module) -> str:
    """Structure plus the plain settings of every module (head counts, flags) that change costs, not shapes."""
    parts = []
    for name, m in model.named_modules():
        settings = sorted(
            (k, v) for k, v in vars(m).items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))
        )
        parts.append(f"{name}:{type(m).__qualname__}:{settings}")
    for name, p in model.named_parameters():
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _cache_key(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


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
) -> ModelDescription:
    """Measure ``model`` on the device its parameters are on (see the module docstring).

    ``example_input``: a tensor (one argument), a tuple (positional arguments)
    or a dict (keyword arguments), batch in dim 0. The model must return a
    scalar loss, or ``loss_fn(output)`` must. ``batch_sizes`` default to half
    the example's and the example's. ``precisions``: "fp32" and/or "bf16"
    (measured on a bf16 copy, as FSDP's mixed precision computes). ``units``
    default to ``osdp.discover_units`` at ``granularity`` with call counts, so
    a module that runs twice per forward is merged into its parent. The model's parameters,
    gradients, buffers and RNG state are left as they were.
    """
    with _buffers_kept(model):
        return _describe(model, example_input, loss_fn=loss_fn, batch_sizes=batch_sizes, precisions=precisions,
                         units=units, granularity=granularity, optimizers=optimizers, repeats=repeats,
                         time_budget_s=time_budget_s, cache=cache, progress=progress, name=name)


@contextlib.contextmanager
def _buffers_kept(model: nn.Module):
    """Buffers as they were after the block: a training forward updates some (BatchNorm's running statistics,
    step counters), and a describe on rank 0 alone must leave them as the other ranks' and an unwrapped run's."""
    saved = {b: b.detach().clone() for b in model.buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved.items():
                b.copy_(value)


def _describe(model, example_input, *, loss_fn, batch_sizes, precisions, units, granularity, optimizers, repeats,
              time_budget_s, cache, progress, name) -> ModelDescription:
    start = time.perf_counter()
    params = list(model.parameters())
    if not params:
        raise ProfileError("the model has no parameters: there is nothing to describe")
    device = params[0].device
    if device.type == "meta":
        raise ProfileError("the model is on the meta device: describe it with osdp.analytic.describe_analytic")
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
    units = resolve_units(model, resize_batch(example_input, sizes[0]), loss_fn, units, granularity)

    key_parts = {
        "version": PROFILE_VERSION, "model": model_fingerprint(model), "units": [u.path for u in units],
        "input": input_spec(example_input), "sizes": sizes, "precisions": list(precisions),
        "device": device_name(device), "torch": torch.__version__, "optimizers": list(optimizers),
        "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)) if loss_fn else None,
    }
    key = _cache_key(key_parts)
    path = cache_dir() / "describe" / f"{key}.json"
    if cache and path.exists():
        try:
            description = ModelDescription.from_json(path.read_text())
            description.from_cache = True
            show.done(f"from cache {path}")
            return description
        except (ValueError, KeyError, TypeError):
            pass  # unreadable entry (older format): measure again

    saved_grads = {p: p.grad for p in params}
    sync = synchronizer(device)
    costs: dict[str, dict[str, UnitWorkload]] = {}
    checks: dict[str, Any] = {}
    order: list[str] = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for prec in precisions:
                runnable = model if prec == "fp32" else _copy_in(model, PRECISIONS[prec])
                runnable_units = build_units(runnable, [u.path for u in units])
                show(f"{prec}: warm-up")
                step_s = _warm_up(runnable, resize_batch(example_input, sizes[-1]), loss_fn)
                reps = repeats or max(2, min(7, int(time_budget_s / len(precisions) / max(step_s, 1e-4) / 2.5 / len(sizes))))
                memory, seconds, recompute = {}, {}, {}
                for i, b in enumerate(sizes):
                    show(f"{prec}: micro-batch {b} ({i + 1}/{len(sizes)}), {reps} timed steps")
                    batch = resize_batch(example_input, b)
                    memory[b], order = memory_pass(runnable, runnable_units, batch, loss_fn)
                    with_ckpt = bool(checkpointable(runnable_units))
                    timing = _time_at(runnable, runnable_units, batch, loss_fn, reps, sync, checkpointed=with_ckpt)
                    seconds[b] = timing["seconds"]
                    checks.setdefault(prec, {})[str(b)] = {k: timing[k] for k in ("step_s", "hooked_step_s")}
                    if with_ckpt:
                        recompute[b] = timing["recompute_seconds"]
                costs[prec] = fit_costs(runnable_units, sizes, memory, seconds, recompute_seconds=recompute or None)
                if runnable is not model:
                    del runnable
            show("timing the optimizers")
            opt = time_optimizers(params, optimizers)
    finally:
        for p, g in saved_grads.items():
            p.grad = g
    description = ModelDescription(
        model=name,
        signature=structure_signature(model),
        units=unit_profiles(model, units, costs),
        batch_sizes=sizes,
        precisions=tuple(precisions),
        optimizer_s_per_byte=opt,
        source=f"measured on {device_name(device)}",
        device=device_name(device),
        input_spec=input_spec(example_input),
        input_bytes_per_sample=input_bytes_per_sample(example_input),
        forward_order=tuple(order),
        checks=checks,
        profile_seconds=time.perf_counter() - start,
        cache_key=key,
        granularity=granularity if given_units is None else "given",
    )
    show.done(f"done in {description.profile_seconds:.1f}s")
    if cache:
        write_atomically(path, description.to_json())
    return description


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


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy with floating parameters and buffers in ``dtype``: what FSDP's mixed precision computes with."""
    return copy.deepcopy(model).to(dtype)


def _warm_up(model: nn.Module, batch: Any, loss_fn) -> float:
    """Two steps (first-call costs, allocator warm-up); returns the second's seconds."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with StepTimer(_device_of(model)) as step:
            _step(model, batch, loss_fn)
    model.zero_grad(set_to_none=True)
    return step.seconds


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
