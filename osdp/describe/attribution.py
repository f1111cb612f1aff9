"""Which unit a second, a saved tensor or a byte of a working set belongs to, while a model trains.

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

import math

import functools
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from osdp.describe.recompute import MATMULS, SAVED_OPS, kept_by_selective, statistics_buffers
from osdp.describe.units import Unit, alike_members, checkpointable, holding_unit, param_homes
from osdp.machine.memory import iter_tensors, written_tensors
from osdp.schema.plan import ROOT


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
        self.calls: dict[str, int] = {}  # unit -> forwards begun so far
        # units whose forward ran without autograd and again in backward: the model's own reentrant checkpoint
        self.without_grad: set[str] = set()
        self.run_in_backward: set[str] = set()
        # units a forward ran with autograd on, and those one such forward handed an input that requires grad:
        # FSDP2 reduces a unit's gradients as its inputs' gradients are computed, the others' only at the end
        self.ran_with_grad: set[str] = set()
        self.took_grad_input: set[str] = set()
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

    @property
    def reduced_at_end(self) -> set[str]:
        """The units no forward of which took an input that requires grad (token ids, a frozen part's output):
        FSDP2 reduces their gradients in the root's final callback (``UnitWorkload.reduced_at_end``)."""
        return self.ran_with_grad - self.took_grad_input

    @property
    def running(self) -> str:
        """The innermost unit whose forward is running (the root outside every unit)."""
        return self.stack[-1] if self.stack else ROOT

    def _pre(self, path: str):
        def hook(_module, args, kwargs):
            self.close(self.running)
            self.stack.append(path)
            self.calls[path] = self.calls.get(path, 0) + 1
            if self.phase == "fwd" and not torch.is_grad_enabled():
                self.without_grad.add(path)
            elif self.phase == "bwd" and path in self.without_grad:
                self.run_in_backward.add(path)
            tensors = list(iter_tensors((args, kwargs)))
            self.inputs[path] = [
                (_storage_key(t), t.untyped_storage().nbytes(), weakref.ref(t.untyped_storage()))
                for t in tensors
                if t.layout == torch.strided
            ]
            if not torch.is_grad_enabled():
                return None
            self.ran_with_grad.add(path)
            if any(t.requires_grad for t in tensors):
                self.took_grad_input.add(path)
            return self._on_input_gradients(path, args, kwargs) if path != ROOT else None

        return hook

    def _post(self, path: str):
        def hook(_module, _args, output):
            self.close(path)
            self.stack.pop()
            if path not in self.finished:
                self.finished.append(path)
            if path != ROOT:
                # the arrival of the unit's output gradient ends a segment of the unit around it
                parent = self.parent.get(path, ROOT)
                for t in iter_tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda _, o=parent: self.close(o))

        return hook

    def _on_input_gradients(self, path: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The unit's inputs as views of themselves, hooked: the gradient of its input ends a segment of the
        unit. Module full backward hooks say the same but return their tensors from a custom Function, and a
        forward that modifies a unit's output in place (``y += x``, ``nn.ReLU(inplace=True)``) fails on those;
        a plain view allows it. Each input its own view, as FSDP2 hands a sharded unit its inputs (so
        MultiheadAttention, which tells self-attention apart by ``query is key``, runs as it runs sharded);
        tensors inside containers are left as they are (a container rebuilt could be another type)."""

        def hooked(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.requires_grad or t.layout != torch.strided:
                return t
            view = t.view_as(t)
            view.register_hook(lambda _, o=path: self.close(o))
            return view

        return tuple(hooked(a) for a in args), {k: hooked(v) for k, v in kwargs.items()}


class LinearRows:
    """Per unit, the most rows (input elements over ``in_features``) a call of one of its ``nn.Linear`` modules took:
    a split Linear's loop makes its per-slice temporaries that many rows tall (``UnitWorkload.split_rows``)."""

    def __init__(self, model: nn.Module, segments: Segments):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        self.segments = segments
        self.rows: dict[str, int] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "LinearRows":
        self._handles = [m.register_forward_pre_hook(self._called) for m in self.linears]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _called(self, module: nn.Linear, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1]:
            owner = self.segments.running
            self.rows[owner] = max(self.rows.get(owner, 0), x.numel() // x.shape[-1])


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


class _LiveBytes:
    """Saved bytes alive, per unit and in all: what the storages' finalizers count down. It holds nothing
    else, so a finalizer left on a storage that outlives the pass (a buffer, a cached mask) keeps only it alive,
    not the model."""

    def __init__(self) -> None:
        self.per_unit: dict[str, int] = {}
        self.total = 0

    def add(self, owner: str, nbytes: int) -> None:
        self.per_unit[owner] = self.per_unit.get(owner, 0) + nbytes
        self.total += nbytes

    def freed(self, owner: str, nbytes: int) -> None:
        self.add(owner, -nbytes)


class _Saved:
    """Saved-tensor attribution: each storage counted once, for the first unit that saves it, if it lives
    until backward.

    Follows how many saved bytes of each unit are alive (``live``), so that a
    memory peak can be split into the running unit's own saved bytes and the
    rest. ``close()`` detaches the finalizers of storages still alive.
    """

    def __init__(self, segments: Segments, param_keys: set[int], chain: Callable[[torch.Tensor], Any] | None):
        # param_keys: the storages of the model's parameters and buffers, which no unit's saving keeps alive
        self.segments, self.param_keys, self.chain = segments, param_keys, chain
        self.first_saver: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}
        # the storage behind each key while it lives: a saved tensor can die in forward (its graph dropped, as a
        # discarded output's), and a later one take its address
        self._storages: dict[int, weakref.ref] = {}
        self._live = _LiveBytes()
        self._finalizers: list[weakref.finalize] = []
        self.added = 0  # every saved byte counted so far, freed or not: what a stretch of the forward saved
        self.saved_again: set[int] = set()  # storages a later unit saved too (a ReLU's output, its consumer's input)

    @property
    def live(self) -> dict[str, int]:
        return self._live.per_unit

    @property
    def total_live(self) -> int:
        return self._live.total

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.chain is not None:
            self.chain(t)
        if self.segments.phase == "fwd" and t.layout == torch.strided:
            key = _storage_key(t)
            known = self._storages.get(key)
            if key in self.param_keys:
                pass
            elif known is not None and known() is not None:
                if self.first_saver[key] != self.segments.running:
                    self.saved_again.add(key)
            else:
                owner = self.segments.running
                nbytes = t.untyped_storage().nbytes()
                self.first_saver[key] = owner
                self.nbytes[key] = nbytes
                self._storages[key] = weakref.ref(t.untyped_storage())
                self._live.add(owner, nbytes)
                self.added += nbytes
                self._finalizers.append(weakref.finalize(t.untyped_storage(), self._live.freed, owner, nbytes))
        return t.detach()  # t itself, an op's output, would hold its own grad_fn: a cycle no gc reclaims

    def close(self) -> None:
        """Stop following the storages: a finalizer is held globally until its storage dies."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

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
        checkpoints only the borrower is over-predicted by those bytes). What
        a unit saved that a later unit saves too (its last ReLU's output, the
        next convolution's input) stays alive when the unit is checkpointed:
        its checkpoint keeps counting it (a plan checkpointing both is
        over-predicted by those bytes).
        """
        out = {p: {"act": 0, "ckpt": 0} for p in paths}
        for key, owner in self.first_saver.items():
            if self._storages[key]() is not None:  # what died in forward is kept by no backward
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
        # what a unit saved that a later unit saved too (a ReLU's output, the next convolution's input) stays alive
        # when the unit is checkpointed, until that unit's backward: the checkpointed unit keeps counting it
        for key in self.saved_again:
            owner = self.first_saver[key]
            if owner in lenders and self._storages[key]() is not None:
                out[owner]["ckpt"] += self.nbytes[key]
        return out


class UnrunMembers:
    """The saved bytes a routed container's members would add to the unit holding it had the example run all of
    them (``osdp.describe.units.routed_containers``): a member the example skipped (a layer LayerDrop dropped, an
    expert no row was routed to) runs in another step, so it is priced as the largest of its same-structure
    siblings that ran. A search priced on the example's draw alone put a later step over the budget."""

    def __init__(self, model: nn.Module, routed: Sequence[str], units: Sequence[Unit], saved: _Saved):
        modules = dict(model.named_modules())
        self.saved, self.unit_paths = saved, [u.path for u in units]
        self.groups: dict[str, list[list[str]]] = {}  # container -> its members, by structure
        for path in routed:
            container = modules.get(path)
            if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                self.groups[path] = alike_members(model, container, path)
        self.bytes: dict[str, int] = {}  # member -> bytes its forwards saved
        self._modules, self._handles, self._start = modules, [], {}

    def __enter__(self) -> "UnrunMembers":
        for groups in self.groups.values():
            for path in (m for members in groups for m in members):
                module = self._modules[path]
                self._handles.append(module.register_forward_pre_hook(
                    lambda *_, p=path: self._start.__setitem__(p, self.saved.added)))
                self._handles.append(module.register_forward_hook(
                    lambda *_, p=path: self.bytes.__setitem__(
                        p, self.bytes.get(p, 0) + self.saved.added - self._start.pop(p, self.saved.added))))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def extra(self) -> dict[str, int]:
        """Per unit holding a routed container: the bytes its members the forward did not call would save."""
        out: dict[str, int] = {}
        for container, groups in self.groups.items():
            holder = holding_unit(container, self.unit_paths)
            for members in groups:
                ran = [self.bytes[m] for m in members if m in self.bytes]
                if ran:
                    out[holder] = out.get(holder, 0) + max(ran) * (len(members) - len(ran))
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
    if ROOT in memory:
        memory[ROOT].update(_root_backward_parts(segments))


def _root_backward_parts(segments: Sequence[tuple[str, str, int, int, int, int]]) -> dict[str, int]:
    """The root's backward working set where it runs: before any other unit's backward (the loss, and the
    head after the last unit), between two of theirs, and after them all (before the first unit: the embedding);
    the cost model meets each with what the units hold there (``UnitWorkload.bwd_head_bytes``)."""
    backward = [(i, owner, working) for i, (phase, owner, working, *_) in enumerate(segments) if phase == "bwd"]
    inner = [i for i, owner, _ in backward if owner != ROOT]
    first, last = (min(inner), max(inner)) if inner else (math.inf, -math.inf)
    root = [(i, working) for i, owner, working in backward if owner == ROOT]
    return {
        "bwd_head": max((w for i, w in root if i < first), default=0),
        "bwd_between": max((w for i, w in root if first < i < last), default=0),
        "bwd_tail": max((w for i, w in root if i > last), default=0),
    }


class KeptBySelective(TorchDispatchMode):
    """Per unit, the bytes selective checkpointing keeps beyond the unit's inputs: the outputs of the ops
    ``recompute.kept_by_selective`` keeps that its own forward runs (in no unit nested in it; matmuls counted
    per call, as the policy counts them), as the checkpoint's cache holds them. Also the FLOPs each policy's
    recompute redoes (``recompute_flops[policy][unit]``): the ops with FLOPs (``torch.utils.flop_counter``'s)
    it does not keep that run before the unit's forward saves its last tensor, as a recompute stops there (the
    checkpoint's early stop: an op's inputs are saved before the op runs, so a unit's last Linear, whose output
    no later op of the unit saves, is never redone). ``saved()`` is to be called on every tensor the forward
    saves. Works on real and on fake tensors."""

    def __init__(self, segments: Segments):
        super().__init__()
        self.segments = segments
        self.bytes: dict[str, int] = {}
        # per unit, what it keeps: (its storage while alive, storage key, bytes). A key alone could name another
        # storage later: a kept output no backward saves dies in forward, and its address is reused
        self.outputs: dict[str, list[tuple[weakref.ref, int, int]]] = {}
        self._matmuls: dict[tuple[str, int], int] = {}  # (unit, call) -> matmuls so far
        self.recompute_flops: dict[str, dict[str, int]] = {"full": {}, "selective": {}}
        # per policy and unit, the FLOPs not kept since the unit's forward last saved a tensor
        self._not_redone_yet: dict[str, dict[str, int]] = {"full": {}, "selective": {}}
        self.keeper: dict[int, tuple[weakref.ref, str]] = {}  # storage key -> (storage, the unit that keeps it)

    def saved(self) -> None:
        """The running unit's forward saved a tensor: what it did not keep so far is redone by its recompute."""
        if self.segments.phase == "fwd":
            owner = self.segments.running
            for policy, pending in self._not_redone_yet.items():
                redone = self.recompute_flops[policy]
                redone[owner] = redone.get(owner, 0) + pending.pop(owner, 0)

    def _not_kept(self, policy: str, owner: str, flops: int) -> None:
        self._not_redone_yet[policy][owner] = self._not_redone_yet[policy].get(owner, 0) + flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.segments.phase != "fwd" or not torch.is_grad_enabled():
            return out
        owner = self.segments.running
        counted = flop_registry.get(func._overloadpacket)
        flops = counted(*args, **(kwargs or {}), out_val=out) if counted is not None else 0
        self._not_kept("full", owner, flops)
        if func not in SAVED_OPS:
            self._not_kept("selective", owner, flops)
            return out
        call = (owner, self.segments.calls.get(owner, 0))
        if func in MATMULS:
            self._matmuls[call] = self._matmuls.get(call, 0) + 1
        if not kept_by_selective(func, self._matmuls.get(call, 0)):
            self._not_kept("selective", owner, flops)
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        kept = [(weakref.ref(t.untyped_storage()), _storage_key(t), t.nelement() * t.element_size())
                for t in outputs if isinstance(t, torch.Tensor)]
        self.bytes[owner] = self.bytes.get(owner, 0) + sum(n for _, _, n in kept)
        self.outputs.setdefault(owner, []).extend(kept)
        for storage, key, _ in kept:
            self.keeper[key] = (storage, owner)
        return out

    def unsaved_bytes(self, path: str, first_saver: Mapping[int, str]) -> int:
        """Of what selective checkpointing keeps of unit ``path``, the bytes its own backward does not save
        (``first_saver``: ``_Saved``'s, after the forward), such as its last matmul's output. The checkpoint's
        cache holds them until the unit's backward ends, beyond the backward's working set: its recompute stops
        before it reaches them. One dead by now was saved by no backward (what is saved lives until backward)."""
        return sum(n for storage, key, n in self.outputs.get(path, ())
                   if storage() is None or first_saver.get(key) != path)


class InPlaceWrites(TorchDispatchMode):
    """The units a checkpoint policy cannot take, from the forward's in-place writes (seen before they run).

    ``inputs_written``: an op wrote to one of a unit's inputs after its forward began (its own
    ``nn.ReLU(inplace=True)`` first, or a later ``x.add_(...)``), before its backward: a checkpoint saves the
    inputs and recomputes from them, so it would read what was written (PyTorch refuses it in backward).
    ``kept_written``: an op wrote to an output selective checkpointing keeps (``KeptBySelective``'s: a unit's
    Linear rectified in place, ``y += x`` on its last matmul); the checkpoint's cache refuses that likewise.
    ``state_written``: a unit's forward wrote to one of the model's buffers or parameters, which it may read
    (spectral_norm's power iteration advances its ``_u`` and ``_v`` each training forward, a step counter a
    forward branches on, a weight decayed or clamped in place):
    a recompute would start from what the forward wrote and compute another output, so backward would
    differentiate what the forward did not run. Normalization layers' running statistics are exempt: a training
    forward does not read them, and the recompute leaves them as the forward did
    (``osdp.describe.recompute``). Works on real and on fake tensors.
    """

    def __init__(self, segments: Segments, kept: KeptBySelective):
        super().__init__()
        self.segments, self.kept = segments, kept
        self.inputs_written: set[str] = set()
        self.kept_written: set[str] = set()
        self.state_written: set[str] = set()
        statistics = {id(b) for b in statistics_buffers(segments.model)}
        self._state = {_storage_key(t) for t in (*segments.model.buffers(), *segments.model.parameters())
                       if id(t) not in statistics}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.segments.phase == "fwd":
            for t in written_tensors(func, args, kwargs or {}):
                self._note(t)
        return func(*args, **(kwargs or {}))

    def _note(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self._state:
            self.state_written.add(self.segments.running)
        storage, owner = self.kept.keeper.get(key, (lambda: None, ""))
        if storage() is not None:
            self.kept_written.add(owner)
        for path, inputs in self.segments.inputs.items():
            if any(k == key and ref() is not None for k, _, ref in inputs):
                self.inputs_written.add(path)

