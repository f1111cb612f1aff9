"""Replicated parameters shown as DTensors between steps, as FSDP2 shows every parameter.

The reducer's parameters (``fsdp_ext.replicate``: every replicated unit's in fp32, and the few FSDP2 cannot
shard) are plain tensors that forward and backward use in place. A ``fully_shard``-ed model's parameters are
DTensors, and code written for one calls DTensor methods on them (``p.full_tensor()``, ``p.device_mesh``,
``p.grad.full_tensor()``), or combines parameters of several units (an EMA update over a student and its
teacher); whether that works must not depend on the plan.

So between steps each such parameter is registered as a DTensor replicated on the world mesh, a view of the
same memory, and its gradient as a DTensor view of the plain one: optimizers built from ``model.parameters()``
step DTensors, as under FSDP2, and write the memory forward uses. From the model's forward until the backward
that follows it has ended (or the forward's end, when no backward can follow; after a forward without
gradients, the root unit's until ``fsdp_ext.evaluation`` puts them at rest) the plain parameters are registered in
their place, as FSDP2 registers its unsharded parameters for forward and backward; a
checkpointed unit's recompute finds them too. What the user changed between steps reaches the plain
parameters as the forward begins: ``requires_grad``, a gradient set to None or replaced, a parameter replaced
in its module (``load_state_dict(..., assign=True)``: its DTensor's memory becomes the new plain parameter,
which the reducer then follows).

Torch's optimizers step the plain parameters: a step hook puts each view's plain parameter in its place in
the optimizer for the step (its state moves with it, and stays plain tensors), as stepping DTensors dispatches
every op through DTensor, 2% of a small model's step on CPU (gpt2-mini, 2 ranks), which DDP does not pay.
L-BFGS and optimizers of the user's own step the views (``steps_each_parameter_alone``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from osdp.fsdp_ext.assigned_data import make_data_assignable
from osdp.fsdp_ext.replicate import mixes_plain_and_dtensors, open_implicit_replication


class ReplicatedView:
    """Switches the reducer's ``slots`` (``fsdp_ext.replicate.Slot``) between the plain parameters (computing) and
    their DTensor views (at rest, the state a wrapped model starts in)."""

    def __init__(self, slots, mesh: DeviceMesh):
        self.slots = slots  # shared with the reducer, which follows replacements of ``slot.param``
        self.mesh = mesh
        self._shown: dict[nn.Parameter, nn.Parameter] = {}  # plain parameter -> its DTensor view
        self._grads: dict[nn.Parameter, DTensor] = {}  # plain parameter -> the view of its gradient last shown
        self.computing = True
        self._kept: set[nn.Parameter] = set()  # plain while the others are at rest (to_rest's keep)
        self.to_rest()
        _step_optimizers_on_plain_parameters()

    def _replicated(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

    def to_compute(self) -> None:
        """Register the plain parameters, carrying over what was changed on the views since they were shown."""
        if self.computing:
            return
        self.computing = True
        self._kept = set()
        made: dict[int, nn.Parameter] = {}  # id(view) -> the plain parameter made for it here (a tied weight: one)
        for slot in self.slots:
            shown = slot.now()
            if shown is None or shown is slot.param:
                continue
            plain, local = slot.param, _local(shown)
            if id(shown) in made:
                plain = made[id(shown)]
            elif shown is not self._shown.get(plain) or plain.device != local.device:
                # replaced while at rest, or given memory on another device (model.to_empty after wrapping on the
                # meta device): a new plain parameter, which the reducer follows
                plain = made[id(shown)] = nn.Parameter(local, requires_grad=shown.requires_grad)
                self._shown[plain] = shown
                shown._osdp_plain, shown._osdp_view = plain, weakref.ref(self)
            elif not _same_memory(local, plain):
                # the view was given memory of its own (Module._apply swaps a DTensor parameter's contents: a
                # Trainer's model.to(device)), which the optimizer has updated since: compute in that memory
                plain.data = local
            if plain.requires_grad != shown.requires_grad:
                plain.requires_grad_(shown.requires_grad)
            self._carry_grad(plain, shown)
            slot.module._parameters[slot.name] = plain

    def carry_grads(self) -> None:
        """As a backward begins: the gradients the user cleared or set on the views since the forward (a
        Lightning step zeroes them between its forward and its backward), so that none accumulates onto a
        gradient the user let go of."""
        for plain, shown in self._shown.items():
            self._carry_grad(plain, shown)

    def register_plain_again(self) -> None:
        """As a backward begins: the plain parameters back where the forward's caller put the views back in their
        place (``torch.func.functional_call`` with the model's own parameters restores what it replaced), so that a
        checkpointed unit's recompute computes with them, as its forward did."""
        for slot in self.slots:
            shown = self._shown.get(slot.param)
            if shown is not None and slot.now() is shown:
                slot.module._parameters[slot.name] = slot.param

    def drop_gradients_not_shown(self) -> None:
        """After a backward that raised (``fsdp_ext.interrupted``): a gradient it left on a plain parameter whose
        view shows none (none before it, or the user's ``zero_grad`` since) goes, as the user's ``zero_grad``
        would have taken it on one process; the others are carried as ``carry_grads`` carries them."""
        for plain, shown in self._shown.items():
            if shown.grad is None and plain.grad is not None:
                plain.grad = None
                self._grads.pop(plain, None)
        self.carry_grads()

    def _carry_grad(self, plain: nn.Parameter, shown: nn.Parameter) -> None:
        grad = shown.grad
        if grad is None:
            if plain.grad is not None and plain in self._grads:  # shown before, cleared since
                plain.grad = None
                self._grads.pop(plain)
        elif grad is self._grads.get(plain):  # the view this object showed
            if plain.grad is None:  # cleared on the plain side (a zero_grad inside an optimizer's step)
                shown.grad = None
                self._grads.pop(plain)
            elif not _same_memory(_local(grad), plain.grad):  # given memory of its own (Module._apply)
                plain.grad = _local(grad)
        else:  # set by the user
            plain.grad = _local(grad)

    def to_rest(self, keep: set[nn.Parameter] = frozenset()) -> None:
        """Register the DTensor views, with views of the plain gradients; the plain parameters in ``keep``
        stay registered until the next call."""
        if not self.computing and not self._kept:
            return
        self.computing = False
        self._kept = set()
        live = set()
        for slot in self.slots:
            now, plain = slot.now(), slot.param
            if now is None or (now is not plain and now is not self._shown.get(plain)):
                continue  # replaced during a step: the next forward takes it
            # ``now`` may be the view already: at rest by the last call (kept the others), or put back by the
            # caller around a forward (torch.func.functional_call with the model's own parameters)
            live.add(plain)
            if now is plain and plain in keep:
                self._kept.add(plain)
                continue
            shown = self._shown.get(plain)
            if shown is not None and not _same_memory(_local(shown), plain):
                shown = self._take_memory_back(plain, shown)
            if shown is None:
                shown = self._shown[plain] = nn.Parameter(self._replicated(plain.detach()),
                                                          requires_grad=plain.requires_grad)
                shown._osdp_plain, shown._osdp_view = plain, weakref.ref(self)  # for the optimizer step
                make_data_assignable(shown)
            elif shown.requires_grad != plain.requires_grad:
                shown.requires_grad_(plain.requires_grad)
            grad = plain.grad
            if grad is None:
                shown.grad = None
                self._grads.pop(plain, None)
            else:
                view = self._grads.get(plain)
                if view is None or not _same_memory(_local(view), grad):
                    view = self._grads[plain] = self._replicated(grad)
                shown.grad = view
            slot.module._parameters[slot.name] = shown
        for gone in [p for p in self._shown if p not in live]:  # replaced parameters: let them go
            self._shown.pop(gone)
            self._grads.pop(gone, None)

    def _take_memory_back(self, plain: nn.Parameter, shown: nn.Parameter) -> nn.Parameter | None:
        """The forward gave ``plain`` memory of its own (``p.data = p.data * m + q.data * (1 - m)``: a momentum
        encoder's update in older code). Its values go to the view's memory, which ``plain`` takes back, so that
        the next forward (which computes in the view's memory, as the user may have swapped it) keeps the write;
        None where the new memory differs in shape or dtype (a new view is made)."""
        local = _local(shown)
        if (local.shape, local.dtype, local.device) != (plain.shape, plain.dtype, plain.device):
            self._shown.pop(plain)
            self._grads.pop(plain, None)
            return None
        with torch.no_grad():
            local.copy_(plain.detach())
        plain.data = local
        return shown


def _local(t: torch.Tensor) -> torch.Tensor:
    """The memory behind ``t``: a DTensor's local tensor (no autograd edge to the DTensor), a tensor itself."""
    return t._local_tensor.detach() if isinstance(t, DTensor) else t.detach()


def _same_memory(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


_SWAPPED_ATTR = "_osdp_stepping_plain"  # on an optimizer during its step: plain parameter -> its view
_step_hooks_installed = False


def _step_optimizers_on_plain_parameters() -> None:
    global _step_hooks_installed
    if not _step_hooks_installed:
        register_optimizer_step_pre_hook(_to_plain)
        register_optimizer_step_post_hook(_to_views)
        _step_hooks_installed = True


def _swap(optimizer: torch.optim.Optimizer, mapping) -> None:
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            other = mapping(p)
            if other is not None:
                params[i] = other
                if p in state:
                    state[other] = state.pop(p)


def steps_each_parameter_alone(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's that update each parameter from its own state and gradient (all
    but L-BFGS, which joins every parameter into one vector). Only those step the plain parameters: any other
    (L-BFGS, the user's own) steps the views, so that what it joins across parameters is DTensors alone, as
    under FSDP2, not plain tensors beside sharded DTensors."""
    cls = type(optimizer)
    return cls.__module__.startswith("torch.optim.") and cls is not torch.optim.LBFGS


def _to_plain(optimizer: torch.optim.Optimizer, *_) -> None:
    if not steps_each_parameter_alone(optimizer):
        return
    swapped = {}

    def plain_of(shown):
        plain = getattr(shown, "_osdp_plain", None)
        if plain is None:
            return None
        view = shown._osdp_view()
        if view is not None:
            view._carry_grad(plain, shown)  # a gradient the user cleared or set since the backward
        swapped[plain] = shown
        return plain

    _swap(optimizer, plain_of)
    if swapped:
        setattr(optimizer, _SWAPPED_ATTR, swapped)
        if mixes_plain_and_dtensors(optimizer):  # plain beside sharded DTensors in one foreach op
            open_implicit_replication()


def _to_views(optimizer: torch.optim.Optimizer, *_) -> None:
    swapped = optimizer.__dict__.pop(_SWAPPED_ATTR, None)
    if swapped:
        _swap(optimizer, swapped.get)
