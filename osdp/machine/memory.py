"""Per-rank peak memory: CUDA allocator statistics on GPUs, a live-bytes tracker on CPU.

The cost model predicts a peak per rank; this is the measurement it is judged
against (DESIGN.md section 8). On CUDA the caching allocator already counts
every tensor byte (``torch.cuda.max_memory_allocated``). On CPU nothing does,
so ``LiveBytesTracker`` counts the bytes of live CPU tensor storages itself,
with the same scope: memory PyTorch allocates for tensors, not a
communication library's own buffers. It counts CUDA storages the same way, so
that ``osdp.describe.measured.describe`` attributes a GPU model's bytes to its units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from osdp._torch_private import (
    TorchDispatchMode,
    ddp_bucket_bytes,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

# When a storage has several roles, the earliest one here names it: a weight
# saved for backward is a parameter, a gradient created as a backward
# temporary becomes a gradient once it is one.
CATEGORIES = (
    "parameters",            # module parameters (for DTensors: the local shard)
    "unsharded_parameters",  # storages re-grown with UntypedStorage.resize_: FSDP's gathered parameters
    "gradients",             # .grad of parameters
    "optimizer_state",       # tensors in optimizer.state
    "buffers",               # module buffers
    "inputs",                # tensors passed as roots (the batch)
    "activations",           # saved for backward (autograd saved-tensor hooks)
    "temporaries",           # everything else allocated while tracking, FSDP's collective buffers included
)
_PARAM, _UNSHARDED, _GRAD, _OPTIM, _BUFFER, _INPUT, _ACT, _TEMP = range(len(CATEGORIES))
_EXTERNAL = len(CATEGORIES)  # allocated out of the tracker's sight: followed, not counted
_TRACKED_DEVICES = ("cpu", "cuda")


def _tracked(t: torch.Tensor) -> bool:
    return (t.is_cpu or t.is_cuda) and t.layout == torch.strided  # (is_* are cheaper than .device, per op)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes of live tensors on one rank over a measured region."""

    device: str
    peak_bytes: int
    baseline_bytes: int  # live when the region started
    current_bytes: int   # live when it ended
    peak_breakdown: Mapping[str, int] = field(default_factory=dict)  # CPU: by CATEGORIES, sums to peak_bytes
    external_peak_bytes: int | None = None  # CPU: see LiveBytesTracker.external_peak_bytes
    peak_reserved_bytes: int | None = None  # CUDA: caching allocator reservation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"peak_breakdown": dict(self.peak_breakdown)}


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) tensor, list, tuple, dict or dataclass instance, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x)
    elif isinstance(obj, Mapping):
        for x in obj.values():
            yield from iter_tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a model's output class
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` in it (nested tuples, lists, dicts) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(fn, x) for x in obj)
    if isinstance(obj, list):
        return [map_tensors(fn, x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _flat_tensors(args: Any) -> list[torch.Tensor]:
    """The tensors of op arguments: tensors, or lists of them (one level deep is what ATen schemas have)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def written_tensors(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The strided tensors an ATen op writes to in place, by its schema (``add_``'s self, ``out=`` tensors)."""
    if not func._schema.is_mutable:
        return []
    named = dict(zip((a.name for a in func._schema.arguments), args)) | dict(kwargs)
    return [t for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
            for t in _flat_tensors((named.get(a.name),)) if t.layout == torch.strided]


class _Storage:
    __slots__ = ("handle", "nbytes", "ref", "counted")

    def __init__(self, handle: int, ref: weakref.ref, counted: bool) -> None:
        self.handle, self.nbytes, self.ref, self.counted = handle, 0, ref, counted


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class _Watch(TorchDispatchMode):
    """Sees every op below autograd, forward and backward (the engine carries the mode to its threads)."""

    def __init__(self, tracker: "LiveBytesTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor & co: let it unwrap; its plain-tensor ops come back here
        kwargs = kwargs or {}
        note = self.tracker._note_storage
        # torch.tensor(data) builds its tensor below dispatch and passes it through
        # lift_fresh: an allocation made here, not a tensor from out of sight.
        if func is not _LIFT_FRESH:
            for t in _flat_tensors(args) + _flat_tensors(kwargs.values()) if kwargs else _flat_tensors(args):
                if _tracked(t):
                    note(t.untyped_storage(), _EXTERNAL, known_ok=True)
        out = func(*args, **kwargs)
        for t in (out,) if isinstance(out, torch.Tensor) else iter_tensors(out):
            if _tracked(t):
                note(t.untyped_storage(), _TEMP)
        return out


class LiveBytesTracker:
    """Counts the bytes of live CPU (and CUDA) tensor storages; records the peak and what it was made of.

    ``roots`` (modules, optimizers, tensors such as the batch) are the state
    that existed before the region: their storages are the baseline, and they
    name the parameter, gradient, optimizer-state, buffer and input bytes.
    Inside the region every op output is seen (a ``TorchDispatchMode``, which
    autograd carries into backward), each storage counted once however many
    views share it, until a weak reference says it was freed. Storages
    re-sized through ``UntypedStorage.resize_`` (how FSDP frees and re-gathers
    unsharded parameters; dispatch does not see it) are followed too.

    Counts are storage bytes, exactly: no allocator rounding or caching, and
    not the scratch memory a kernel allocates and frees inside one op.
    Tensors outside ``roots`` that existed before the region are not counted;
    nor are storages allocated where dispatch cannot see them (first met as
    an op input), which ``external_peak_bytes`` reports apart: dispatch modes
    are per thread, so these are tensors made on other threads. On gloo that
    is the full-size copy of its input that gloo's own reduce-scatter makes
    on its thread and frees whenever that thread drops it; leaving it out
    keeps the peak deterministic and in the scope of
    ``torch.cuda.max_memory_allocated``, which does not count NCCL's buffers
    either. The reduce-scatter osdp installs makes that copy in sight and
    frees it before it returns (``osdp.distributed.collectives``).

    Meant for a few steps: it keeps one small record per allocation and free
    for the peak breakdown; ``reset_peak`` starts a new window.

    Example::

        with LiveBytesTracker(model, optimizer, batch) as tracker:
            loss_fn(model(batch)).backward()
            optimizer.step()
        tracker.peak_bytes, tracker.peak_breakdown()
    """

    def __init__(self, *roots: nn.Module | torch.optim.Optimizer | torch.Tensor, saved_tensors: bool = True) -> None:
        for r in roots:
            if not isinstance(r, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
                raise TypeError(f"roots must be modules, optimizers or tensors, got {type(r).__name__}")
        self._roots = roots
        # with saved_tensors, tensors saved for backward are told apart as activations (a saved-tensors hook,
        # which must be entered outside any forward: inside one, checkpointing's own hooks are out of order)
        self._classify_saved = saved_tensors
        self._lock = threading.RLock()  # frees arrive from any thread, possibly inside our own calls
        self._live: dict[int, _Storage] = {}  # StorageImpl address -> record, while alive
        self._category: list[int] = []  # by handle; kept after the free for the breakdown
        self._base: dict[int, int] = {}  # handle -> bytes at the start of the window
        self._events: list[tuple[int, int]] = []  # (handle, byte delta) since then
        self._current = self._peak = self._baseline = self._peak_events = 0
        self._external = self._external_peak = 0
        self._active = False

    # ----------------------------------------------------------------- context

    def __enter__(self) -> "LiveBytesTracker":
        if self._active:
            raise RuntimeError("LiveBytesTracker is not reentrant")
        self._active = True
        self._orig_resize = torch.UntypedStorage.resize_
        tracker, orig_resize = self, self._orig_resize

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            out = orig_resize(storage, nbytes)
            if storage.device.type in _TRACKED_DEVICES:
                tracker._note_storage(storage, _UNSHARDED if nbytes else _TEMP)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._hooks = [
            register_optimizer_step_pre_hook(self._on_step),
            register_optimizer_step_post_hook(self._on_step),
        ]
        self._saved = (torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if self._classify_saved
                       else contextlib.nullcontext())
        self._saved.__enter__()
        self._classify_roots()
        self.reset_peak()
        self._watch = _Watch(self)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._watch.__exit__(*exc)
        self._classify_roots()
        self._saved.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        with self._lock:
            self._live.clear()  # drops the weak references: no callbacks after this
        self._active = False

    # ----------------------------------------------------------------- results

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def baseline_bytes(self) -> int:
        return self._baseline

    @property
    def external_peak_bytes(self) -> int:
        """Most bytes alive at once in storages allocated out of sight (not in ``peak_bytes``)."""
        return self._external_peak

    def mark(self, t: torch.Tensor, category: str) -> None:
        """Say what a tensor's storage is, e.g. a gradient the moment it is accumulated.

        The earliest of CATEGORIES a storage was given names it, so marking a
        parameter "activations" changes nothing. Storages not seen before join
        the count here.
        """
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        self._note(t, CATEGORIES.index(category))

    def reset_peak(self) -> None:
        """Start a new window: peak and baseline become the bytes live now."""
        with self._lock:
            self._base = {rec.handle: rec.nbytes for rec in self._live.values() if rec.counted and rec.nbytes}
            self._events = []
            self._peak = self._baseline = self._current
            self._peak_events = 0
            self._external_peak = self._external

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by category at the peak; the values sum to ``peak_bytes``."""
        return self._breakdown(self._peak_events)

    def current_breakdown(self) -> dict[str, int]:
        return self._breakdown(len(self._events))

    def stats(self) -> MemoryStats:
        return MemoryStats(
            "cpu", self._peak, self._baseline, self._current, self.peak_breakdown(), self._external_peak
        )

    def _breakdown(self, n_events: int) -> dict[str, int]:
        # Categories are read now, not at the time: a temporary that later became
        # a gradient counts as a gradient, which is what those bytes were.
        with self._lock:
            live = dict(self._base)
            for handle, delta in self._events[:n_events]:
                live[handle] = live.get(handle, 0) + delta
            out = dict.fromkeys(CATEGORIES, 0)
            for handle, nbytes in live.items():
                out[CATEGORIES[self._category[handle]]] += nbytes
        return out

    # ----------------------------------------------------------------- bookkeeping

    def _note(self, t: torch.Tensor, category: int) -> None:
        if is_traceable_wrapper_subclass(t):  # DTensor: its local tensor (the mesh is not a tensor)
            for inner in iter_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]]):
                self._note(inner, category)
        elif _tracked(t):
            self._note_storage(t.untyped_storage(), category)

    def _note_storage(self, storage: torch.UntypedStorage, category: int, known_ok: bool = False) -> None:
        """Register a storage not seen before; else upgrade its category and follow its size.

        ``known_ok`` (op inputs): only storages not seen before matter.
        """
        key = storage._cdata
        if known_ok and key in self._live:  # the common case, decided without the lock
            return
        with self._lock:
            rec = self._live.get(key)
            if rec is None:
                ref = weakref.ref(storage, partial(self._on_free, key))
                rec = _Storage(len(self._category), ref, counted=category != _EXTERNAL)
                self._category.append(category)
                self._live[key] = rec
            elif known_ok:
                return
            elif category < self._category[rec.handle]:
                self._category[rec.handle] = category
            nbytes = storage.nbytes()
            if nbytes != rec.nbytes:
                self._change(rec, nbytes - rec.nbytes)
                rec.nbytes = nbytes

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            rec = self._live.get(key)
            if rec is not None and rec.ref is ref:
                del self._live[key]
                if rec.nbytes:
                    self._change(rec, -rec.nbytes)

    def _change(self, rec: _Storage, delta: int) -> None:
        if not rec.counted:
            self._external += delta
            self._external_peak = max(self._external_peak, self._external)
            return
        self._events.append((rec.handle, delta))
        self._current += delta
        if self._current > self._peak:
            self._peak, self._peak_events = self._current, len(self._events)

    def _note_ddp_buckets(self, ddp: DistributedDataParallel) -> None:
        """A DDP model's flat gradient buckets: made by its C++ reducer out of dispatch's sight, alive all
        along. Counted as gradients, from DDP's own record of their sizes; with ``gradient_as_bucket_view``
        the gradients are those buckets and are counted as gradients already."""
        key = -id(ddp)  # never a storage address
        if ddp.gradient_as_bucket_view or key in self._live:
            return
        with self._lock:
            rec = _Storage(len(self._category), None, counted=True)
            self._category.append(_GRAD)
            self._live[key] = rec
            rec.nbytes = ddp_bucket_bytes(ddp)
            self._change(rec, rec.nbytes)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._note(t, _ACT)
        # detached: t itself, when it is the op's output, would hold its own grad_fn, a cycle that keeps a graph
        # never run backward (a discarded output's) alive for good, and counted as activations
        return t.detach()

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if any(optimizer is r for r in self._roots):
            self._classify_roots()

    def _classify_roots(self) -> None:
        def params(ps: Any) -> None:
            for p in ps:
                self._note(p, _PARAM)
                if p.grad is not None:
                    self._note(p.grad, _GRAD)

        for root in self._roots:
            if isinstance(root, nn.Module):
                if isinstance(root, DistributedDataParallel):
                    self._note_ddp_buckets(root)
                params(root.parameters())
                for storage in hidden_gradient_storages(root):  # gradients live there, between steps too
                    self._note_storage(storage, _GRAD)
                for b in root.buffers():
                    self._note(b, _BUFFER)
            elif isinstance(root, torch.optim.Optimizer):
                for group in root.param_groups:
                    params(group["params"])
                for state in root.state.values():
                    for t in iter_tensors(state):
                        self._note(t, _OPTIM)
            else:
                self._note(root, _INPUT)


# Where a wrapped model keeps gradients that no parameter's .grad shows between steps (a reducer's buckets):
# functions of the model, registered by whoever wraps it (osdp.fsdp_ext.apply), so that this module, which
# the wrapping code uses, needs none of it.
_GRADIENT_STORAGE_SOURCES: list = []


def register_gradient_storages(source) -> None:
    """``source(model)`` gives storages of gradients that live in ``model`` all step: count them as gradients."""
    if source not in _GRADIENT_STORAGE_SOURCES:
        _GRADIENT_STORAGE_SOURCES.append(source)


def hidden_gradient_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    return [s for source in _GRADIENT_STORAGE_SOURCES for s in source(model)]


class PeakMemory:
    """Peak memory of one rank over a ``with`` block, as DESIGN.md section 8 measures it.

    CUDA: ``torch.cuda.max_memory_allocated`` (and reserved) after a reset,
    synchronised at both ends. CPU: a ``LiveBytesTracker`` over ``roots``.
    ``stats()`` reads the result.
    """

    def __init__(self, device: torch.device | str, *roots: nn.Module | torch.optim.Optimizer | torch.Tensor,
                 saved_tensors: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"peak memory is measured on cpu or cuda, not {self.device.type}")
        self._tracker = LiveBytesTracker(*roots, saved_tensors=saved_tensors) if self.device.type == "cpu" else None
        self._stats: MemoryStats | None = None

    def __enter__(self) -> "PeakMemory":
        if self._tracker is not None:
            self._tracker.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._stats = self._tracker.stats()
        else:
            torch.cuda.synchronize(self.device)
            self._stats = MemoryStats(
                str(self.device),
                peak_bytes=torch.cuda.max_memory_allocated(self.device),
                baseline_bytes=self._baseline,
                current_bytes=torch.cuda.memory_allocated(self.device),
                peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            )

    def stats(self) -> MemoryStats:
        if self._stats is None:
            raise RuntimeError("PeakMemory.stats() is available after the with block")
        return self._stats
