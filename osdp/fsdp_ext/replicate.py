"""Replicated units' gradients, reduced as ``DistributedDataParallel`` reduces them, driven by the gradients.

Every replicated unit's parameters share one reducer: their gradients live in
flat buckets (1 MiB first, then up to 25 MiB, reordered after the first backward
to the order it produced them on rank 0, as DDP does) and each bucket is all-reduced
asynchronously as soon as every parameter in it has its gradient, while backward
goes on; the backward waits for them at its end. Parameters are plain tensors,
used in place: no second copy during forward and backward (between steps the
model shows them as DTensor views: ``fsdp_ext.replicated_view``). Sharded units around
and inside them are FSDP2's, which leaves these parameters alone
(``ignored_params``).

The reducer follows the gradients, not the forward, so whatever the user's code
does that FSDP2 allows stays allowed here (DESIGN.md section 9):

* a parameter that gets no gradient in a backward (a branch not taken, an
  output not used) is still reduced: each bucket carries one flag per parameter,
  summed by the same all-reduce, and a parameter no rank used keeps no gradient,
  as on one process; the buckets of a backward that some parameters skipped are
  all-reduced as it ends, in the same order on every rank;
* ``requires_grad`` changed after wrapping (either way) rebuilds the buckets at
  the next forward or backward, so unfrozen parameters are reduced too; a change
  in the middle of a backward raises on every rank;
* a parameter replaced in its module (``load_state_dict(..., assign=True)``, as
  FSDP2's tutorial loads, or an attribute set) is followed at the next forward:
  the reducer reduces what the model holds now, with the settings the old one
  had, as FSDP2 adopts the tensors a load assigns;
* a model called twice before one backward, parameters used outside their
  unit's forward, several backwards per step: every gradient that arrives is
  reduced once, and the all-reduce is linear, so what was reduced before stays;
* gradient sync is per parameter (``set_requires_gradient_sync`` on the model or
  on a unit, ``fsdp_ext.module_api``), so accumulation windows may differ by unit.

Plans in bf16 replicate with FSDP2 instead (``fsdp_ext.apply``): compute in
bf16 needs a bf16 copy of the parameters either way, which FSDP2's
``MixedPrecisionPolicy`` makes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from osdp._torch_private import output_tensors, queue_at_backward_end, set_implicit_replication
from osdp.describe.units import sparse_gradients_message
from osdp.fsdp_ext.forward_errors import refuse_returned_gradients

FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's: the first bucket small, so the first all-reduce starts early
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb


class UnusedParametersError(RuntimeError):
    """Kept for code written against osdp 0.x: replicated parameters without a gradient are reduced now."""


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # each parameter's gradient, in ``buffer``
    used: torch.Tensor  # one flag per parameter, after the gradients in ``buffer``: summed by the all-reduce
    buffer: torch.Tensor
    fired: int = 0  # parameters whose gradient arrived in this backward
    work: dist.Work | None = None


@dataclass(eq=False)
class _Param:
    bucket: _Bucket
    index: int  # in the bucket
    reduce: bool = True  # set_requires_gradient_sync
    all_reduce: bool = True  # set_requires_all_reduce
    divide_by: float | None = None  # set_gradient_divide_factor (None: the world size)
    used_since_reduced: bool = False  # a gradient arrived since its last reduction (locally)
    holds_reduced: bool = False  # its view holds its reduced gradient, nothing accumulated since
    fired: bool = field(default=False)  # in this backward


def _gradient_hook(reducer: "ReplicaReducer") -> Callable[[nn.Parameter], None]:
    """The hook a parameter keeps, referring to the reducer weakly (the model holds the reducer). Autograd
    keeps a parameter's hooks where the garbage collector cannot see them, so parameter -> hook -> reducer ->
    parameter would be a cycle never freed: a model wrapped and then dropped would stay in memory."""
    ref = weakref.ref(reducer)

    def hook(param: nn.Parameter) -> None:
        r = ref()
        if r is not None:
            r._on_gradient(param)

    return hook


@dataclass(eq=False)
class Slot:
    """Where a parameter is registered: ``module._parameters[name]`` (``path``: its name in the model)."""

    module: nn.Module
    name: str
    path: str
    param: nn.Parameter  # what the reducer last saw there

    def now(self) -> nn.Parameter | None:
        return self.module._parameters.get(self.name)


def _slots(model: nn.Module, params: set[nn.Parameter]) -> list[Slot]:
    """Every place ``params`` are registered in ``model``, in ``model.parameters()`` order (a tied weight: each)."""
    return [Slot(module, name, f"{prefix}.{name}" if prefix else name, p)
            for prefix, module in model.named_modules()
            for name, p in module._parameters.items() if p is not None and p in params]


class ReplicaReducer:
    """One reducer over ``params`` (name -> parameter, in ``model.parameters()`` order) of ``model``'s
    replicated units. Collective to build (every replica starts from rank 0's values, as DDP's do)."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], group: dist.ProcessGroup | None = None):
        self.names = {p: name for name, p in params.items()}
        self.params = list(params.values())
        self.slots = _slots(model, set(self.params))
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self._fake = dist.get_backend(self.group) == "fake"  # collectives do nothing (memory planning)
        self._settings: dict[nn.Parameter, dict] = {}
        self._state: dict[nn.Parameter, _Param] = {}
        self._buckets: list[_Bucket] = []
        self._hooks: dict[nn.Parameter, tuple[torch.utils.hooks.RemovableHandle, ...]] = {}
        self._requires_grad: tuple[bool, ...] = ()
        self._order: dict[nn.Parameter, None] = {}  # the order gradients first arrived in, to rebuild by
        self._reordered = False
        self._any_reducing = True
        self._in_backward = False
        self._next = 0  # the next bucket to all-reduce in this backward: in bucket order, on every rank
        self._mixed = any(isinstance(p, DTensor) for p in model.parameters())
        self.view = None  # fsdp_ext.replicated_view: the parameters shown as DTensors between steps
        self.root_slots: list[Slot] = []  # the root unit's own: plain after a forward without gradients
        # a model built on the meta device gets its memory and values after wrapping (model.to_empty, then the
        # user's initialisation): rank 0's values and the buckets wait for its first forward
        self._on_meta = any(p.is_meta for p in self.params)
        if not self._on_meta:
            self._broadcast_from_rank0()
        self._build()
        _step_mixed_optimizers_with_implicit_replication()
        self._forward_hooks = [
            model.register_forward_pre_hook(self._pre_forward, prepend=True),
            model.register_forward_hook(self._post_forward),
        ]

    # -- what the user's calls set -----------------------------------------------------------------

    def set_requires_gradient_sync(self, params, requires_gradient_sync: bool) -> None:
        for p in params:
            self._setting(p)["reduce"] = self._setting(p)["all_reduce"] = requires_gradient_sync
        self._apply_settings()

    def set_requires_all_reduce(self, params, requires_all_reduce: bool) -> None:
        for p in params:
            self._setting(p)["all_reduce"] = requires_all_reduce
        self._apply_settings()

    def set_gradient_divide_factor(self, params, factor: float | None) -> None:
        for p in params:
            self._setting(p)["divide_by"] = factor
        self._apply_settings()

    def bucket_storages(self) -> list[torch.UntypedStorage]:
        """The gradient buckets: memory to count (the replicated gradients are views into them)."""
        return [b.buffer.untyped_storage() for b in self._buckets]

    def _setting(self, p: nn.Parameter) -> dict:
        return self._settings.setdefault(p, {})

    def _apply_settings(self) -> None:
        for p, state in self._state.items():
            for key, value in self._settings.get(p, {}).items():
                setattr(state, key, value)
        self._any_reducing = any(s.reduce and s.all_reduce for s in self._state.values())

    # -- buckets --------------------------------------------------------------------------------------

    def _materialize(self) -> None:
        """At the first forward of a model wrapped on the meta device (given memory since: apply's first-forward
        check says so otherwise): every replica from rank 0's values, and the buckets on the model's device."""
        self._broadcast_from_rank0()
        self._build()
        self._on_meta = False

    def _broadcast_from_rank0(self) -> None:
        if self.params and not self._fake:
            with torch.no_grad():
                for p in self.params:
                    dist.broadcast(p.detach(), src=dist.get_global_rank(self.group, 0), group=self.group)

    def _build(self) -> None:
        """Buckets over the parameters that require a gradient: in the first backward's order once known,
        else in reverse (the order backward roughly produces them), by dtype and device."""
        trained = [p for p in self.params if p.requires_grad]
        order = [p for p in self._order if p.requires_grad] if self._reordered else []
        seen = set(order)
        order += [p for p in reversed(trained) if p not in seen]
        old = self._state
        self._buckets, self._state = [], {}
        pending: dict[tuple, list[nn.Parameter]] = {}
        for p in order:
            key = (p.dtype, p.device)
            group = pending.setdefault(key, [])
            group.append(p)
            cap = FIRST_BUCKET_BYTES if not self._buckets else BUCKET_BYTES
            if sum(q.numel() for q in group) * p.element_size() >= cap:
                self._buckets.append(self._bucket(pending.pop(key)))
        for group in pending.values():
            self._buckets.append(self._bucket(group))
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                before = old.get(p)
                self._state[p] = _Param(bucket, i, used_since_reduced=before is not None and before.used_since_reduced,
                                        holds_reduced=before is not None and before.holds_reduced)
        self._apply_settings()
        for p in list(self._hooks):
            if p not in self._state:
                for handle in self._hooks.pop(p):
                    handle.remove()
        for p in self._state:
            if p not in self._hooks:
                self._hooks[p] = (p.register_post_accumulate_grad_hook(_gradient_hook(self)),
                                  p.register_hook(refuse_returned_gradients(p, self.names[p])))
        self._requires_grad = self._requires_grad_now()

    def _bucket(self, params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        p0 = params[0]
        buffer = torch.zeros(numel + len(params), dtype=p0.dtype, device=p0.device)
        views, offset = [], 0
        with torch.no_grad():
            for p in params:
                view = buffer[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:  # gradients accumulated so far move into the bucket
                    view.copy_(p.grad)
                    p.grad = view
                views.append(view)
                offset += p.numel()
        return _Bucket(params, views, buffer[numel:], buffer)

    def _follow_replaced(self) -> None:
        """Reduce the parameters the model holds now where some were replaced in their modules since (a load
        that assigns): each takes the old one's settings and place in the gradients' order."""
        replaced = {}
        for slot in self.slots:
            now = slot.now()
            if now is not slot.param and now is not None:
                replaced[slot.param] = now
                slot.param = now
        if not replaced:
            return
        current = list(dict.fromkeys(slot.param for slot in self.slots))
        self.names = {slot.param: slot.path for slot in reversed(self.slots)}  # a tied weight: its first name
        self.params = current
        for old, new in replaced.items():
            if old in self._settings:
                self._settings[new] = dict(self._settings[old])
        self._settings = {p: setting for p, setting in self._settings.items() if p in self.names}
        self._order = {replaced.get(p, p): None for p in self._order}
        self._build()

    def _requires_grad_now(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.params)

    def _follow_requires_grad(self) -> None:
        if self._requires_grad_now() != self._requires_grad:
            self._build()

    # -- forward and backward -------------------------------------------------------------------------

    def _pre_forward(self, *_) -> None:
        if not self._in_backward:
            if self._mixed:
                close_implicit_replication()
            if self.view is not None:
                self.view.to_compute()
            self._follow_replaced()
            if self._on_meta:
                self._materialize()
            self._follow_requires_grad()

    def _post_forward(self, _module, _args, output):
        if torch.is_grad_enabled() and self._mixed:
            # backward, clipping and stepping come next (see open_implicit_replication); not from the end of
            # the backward: the autograd engine restores the thread's DTensor settings when it ends
            open_implicit_replication()
        # A rank whose backward gives none of these parameters a gradient must still join the others'
        # all-reduces: the backward through the output arms the reducer too.
        # (Armed with nothing to reduce too, every parameter frozen: the backward's end shows the views again.)
        grads_from = [t for t in output_tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if grads_from and (self._state or self.view is not None):
            register_multi_grad_hook(grads_from, self._arm, mode="any")
        elif not grads_from and self.view is not None and not self._in_backward:
            # no backward through this forward: the step's parameters are the views again, but for the root's
            # after a forward without gradients, which stay plain as FSDP2 keeps its root gathered until
            # fsdp_ext.evaluation calls rest()
            self.view.to_rest(keep=set() if torch.is_grad_enabled() else {s.param for s in self.root_slots})
        return output

    def rest(self) -> None:
        """Show every parameter as a DTensor again (outside a backward)."""
        if self.view is not None and not self._in_backward:
            self.view.to_rest()

    def _arm(self, *_) -> None:
        if self._in_backward:
            return
        if self.view is not None:
            if self.view.computing:
                self.view.carry_grads()
                self.view.register_plain_again()
            else:  # a second backward through a retained graph: a checkpointed unit's recompute computes again
                self.view.to_compute()
        self._follow_requires_grad()
        self._let_reduced_pass_the_divide_factor()
        self._in_backward = True
        self._next = 0
        queue_at_backward_end(self._end_backward)

    def _let_reduced_pass_the_divide_factor(self) -> None:
        # A reduced gradient goes on accumulating in its view, and the next reduction averages the view (divides
        # it by the world size, sums) before it multiplies by world_size / factor: the part reduced before would
        # be multiplied too. Put in the units of a local gradient now (x factor / world_size), it comes out as it
        # is. (Read before that reduction, in a no-sync backward, it shows so scaled.)
        with torch.no_grad():
            for p, state in self._state.items():
                view = state.bucket.views[state.index]
                if state.holds_reduced and state.divide_by is not None and p.grad is not None \
                        and p.grad.data_ptr() == view.data_ptr():
                    view.mul_(state.divide_by / self.world_size)
                state.holds_reduced = False

    def _on_gradient(self, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.layout != torch.strided:  # F.embedding(..., sparse=True)
            raise RuntimeError(sparse_gradients_message(self.names.get(param, "a replicated parameter")))
        self._arm()
        state = self._state.get(param)
        if state is None:
            return  # unfrozen after this backward began: _end_backward raises
        if state.fired:  # a second gradient in one backward (reentrant checkpointing of a shared weight)
            if state.bucket.work is not None:
                raise RuntimeError(
                    f"replicated parameter {self.names[param]} got a second gradient in one backward after its "
                    "bucket was reduced (a weight shared by two reentrant checkpointed regions): checkpoint with "
                    "use_reentrant=False, as osdp's own checkpointing does"
                )
            return
        state.fired = True
        state.used_since_reduced = True
        view = state.bucket.views[state.index]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():  # into the bucket at once (as DDP does): the new gradient is freed now
                view.copy_(param.grad)
            param.grad = view
        if not self._order_known() and param not in self._order:
            self._order[param] = None
        if not self._any_reducing:
            return
        state.bucket.fired += 1
        while self._next < len(self._buckets) and self._buckets[self._next].fired == len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _order_known(self) -> bool:
        return self._reordered or len(self._order) >= len(self._state)

    def _launch(self, bucket: _Bucket) -> None:
        """Fill ``bucket`` with this rank's gradients (and used flags) and start its all-reduce."""
        with torch.no_grad():
            for i, p in enumerate(bucket.params):
                state, view = self._state[p], bucket.views[i]
                if not (state.reduce and state.all_reduce):  # accumulates locally this time: out of the bucket
                    if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                        p.grad = view.clone()
                    view.zero_()
                    bucket.used[i] = 0
                    continue
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
                bucket.used[i] = 1 if state.used_since_reduced else 0
            # divided before the all-reduce, as DDP's hook does: it runs here, while backward goes on
            bucket.buffer[:bucket.buffer.numel() - len(bucket.params)].div_(self.world_size)
        bucket.work = None if self._fake else dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    @property
    def cut_short(self) -> bool:
        """Whether a backward that armed the reducer raised before its end, and none runs now."""
        return self._in_backward and torch._C._current_graph_task_id() == -1

    def reset_iter_state(self) -> None:
        """Start clean after a backward that raised before its end (``fsdp_ext.interrupted``): what it reduced
        stays, as what a backward accumulated before it raised stays on one process."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.fired, bucket.work = 0, None
        for state in self._state.values():
            state.fired = False
        self._in_backward = False
        if self.view is not None:
            self.view.drop_gradients_not_shown()

    def _end_backward(self) -> None:
        self._in_backward = False
        changed = self._requires_grad_now() != self._requires_grad
        try:
            if changed:
                flipped = [self.names[p] for p, was in zip(self.params, self._requires_grad) if p.requires_grad != was]
                raise RuntimeError(
                    f"requires_grad of replicated parameters changed during a backward ({', '.join(flipped[:4])}"
                    f"{' ...' if len(flipped) > 4 else ''}): their gradients were not reduced. Change "
                    "requires_grad between steps (after optimizer.step(), before the next forward)"
                )
            if self._any_reducing:
                while self._next < len(self._buckets):  # what some parameters' absence held back
                    self._launch(self._buckets[self._next])
                    self._next += 1
                for bucket in self._buckets:
                    self._finish(bucket)
        finally:
            for bucket in self._buckets:
                bucket.fired, bucket.work = 0, None
            for state in self._state.values():
                state.fired = False
            if changed:
                self._build()
            elif not self._reordered and self._any_reducing:
                self._reordered = True
                self._order = self._rank0_order()
                built = [p for b in self._buckets for p in b.params]
                if len(built) != len(self._order) or any(a is not b for a, b in zip(self._order, built)):
                    self._build()
            if self.view is not None:  # after any rebuild: the views show the gradients where they now live
                self.view.to_rest()

    def _rank0_order(self) -> dict[nn.Parameter, None]:
        """The order gradients first arrived in on rank 0, which every rank buckets by (as DDP rebuilds its
        buckets): a parameter used on some ranks only arrives at different places on each."""
        arrived = {p: i for i, p in enumerate(self._order)}
        position = torch.tensor([arrived.get(p, -1) for p in self.params], dtype=torch.int64,
                                device=self.params[0].device)
        if not self._fake:
            dist.broadcast(position, src=dist.get_global_rank(self.group, 0), group=self.group)
        first = sorted((i, p) for p, i in zip(self.params, position.tolist()) if i >= 0)
        return {p: None for _, p in first}

    def _finish(self, bucket: _Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        with torch.no_grad():
            # read on the host only where this rank has no gradient (no device sync otherwise)
            used = bucket.used.tolist() if any(p.grad is None for p in bucket.params) else None
            for i, p in enumerate(bucket.params):
                state = self._state[p]
                if not (state.reduce and state.all_reduce):
                    continue
                state.used_since_reduced = False
                view = bucket.views[i]
                if p.grad is None and used[i] == 0:
                    continue  # no rank gave it a gradient: none, as on one process
                if state.divide_by is not None:
                    view.mul_(self.world_size / state.divide_by)
                if p.grad is not view:
                    p.grad = view
                state.holds_reduced = True


# A model with replicated and sharded units holds plain tensors (the reducer's) beside DTensors (FSDP2's and
# split weights). DTensor ops refuse such a mix, and the calls that take every parameter at once do mix them:
# an optimizer's foreach step, ``torch.nn.utils.clip_grad_norm_``. From the end of a training forward of such
# a model to the end of the next optimizer step (backward, clipping, stepping), and during the step of any
# optimizer holding both kinds, DTensor takes the plain tensors as replicated: they are, the reducer has made
# them equal on every rank. The window closes at the next forward if no optimizer steps.
_hooks_installed = False


def open_implicit_replication() -> None:
    set_implicit_replication(True)


def close_implicit_replication() -> None:
    set_implicit_replication(False)


def mixes_plain_and_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    kinds = {isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]}
    return len(kinds) == 2


def _enter_implicit_replication(optimizer: torch.optim.Optimizer, *_) -> None:
    if mixes_plain_and_dtensors(optimizer):
        open_implicit_replication()


def _step_mixed_optimizers_with_implicit_replication() -> None:
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_enter_implicit_replication)
        register_optimizer_step_post_hook(lambda *_: close_implicit_replication())
        _hooks_installed = True
