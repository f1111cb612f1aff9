"""FSDP2's errors from inside a user's forward and backward, said in the plan's terms: what they did and what works.

Two things a forward may do fail under some plans only, with messages about DTensor and custom Functions that
name neither the parameter's unit nor the fix:

* use a parameter outside its module's forward (a head tied by ``F.linear(x, self.wte.weight)``, a weight
  read before its module runs, a momentum update from one encoder to another) while the plan holds it sharded
  there: DTensor refuses the mix of its shard with plain tensors;
* write in place to what a unit took or gave (``x += self.block(x)`` on a block's input), which FSDP2's
  backward hooks hand over as views of a custom Function.

And a backward building a graph (``torch.autograd.grad(..., create_graph=True)``: WGAN-GP's gradient penalty,
MAML's inner step) through a unit FSDP2 holds: FSDP2 frees the unit's gathered parameters when that backward
ends, and the created graph's own backward then fails on freed memory (or, told to keep them, loses gradients
reduced too early). Replicated units keep their parameters whole and take it; ``double_backward_error`` names
the unit.

And a loss combining the model's output with parameters read between forward and backward (a regulariser
``loss + sum(p.square().sum() for p in model.parameters())``): where the plan frees a unit's gathered parameters
after forward (zero3, split) they are its DTensor shards there, and the DTensor part of the loss sends DTensor
gradients into the plain graph, which fails deep in backward, in a place that depends on the plan;
``refuse_dtensor_gradients_into_outputs`` raises as that backward begins, on every rank alike.

And ``torch.autograd.grad`` with respect to parameters: gradients reach the ranks' average only as a backward
accumulates them (DDP's reducer and FSDP2's reduce-scatter run from there), so the gradients it returns are each
rank's own. Where the plan holds a unit sharded, its parameters are DTensors outside the graph and torch refuses;
where it holds one gathered (replicated, zero2 after forward), ``refuse_returned_gradients`` makes that backward
raise as it ends, on every rank alike, rather than return what one process would not.

A searched plan and a baseline given ``example_input`` find such modules in a forward of the example and make
the module that uses the parameter, or writes, the unit. A plan given without an example cannot; each unit's
forward turns the error into ``UnitBoundaryError`` saying so, on every rank alike (every rank runs the same
forward to the same op), before any collective of that step.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from osdp._torch_private import gradient_returned_not_accumulated, output_tensors, queue_at_backward_end
from osdp.schema.plan import PlanError

_MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"
# what DTensor says of an op with a sharded parameter where it allows plain tensors beside (implicit replication)
_NO_SHARDING_STRATEGY = "does not have a sharding strategy registered"
_WRITTEN_VIEW = "RegisterPostBackwardFunction is a view and is being modified inplace"

_FIX = ("osdp.wrap(model, device_mem=..., example_input=batch) and osdp.wrap(model, strategy=..., "
        "example_input=batch) find such modules in a forward of the example and make the module using the "
        "parameter (or writing) the unit; a plan given as it is must do so itself, or replicate that unit")


class UnitBoundaryError(PlanError, RuntimeError):
    """The model's forward used a parameter, or wrote a tensor, across a unit's boundary that the plan cannot
    carry (the message says what and how to plan it)."""


def explained(error: RuntimeError, module_type: str) -> UnitBoundaryError | None:
    text = str(error)
    if _MIXED_DTENSOR in text or _NO_SHARDING_STRATEGY in text:
        return UnitBoundaryError(
            f"{module_type}'s forward used a parameter that this plan holds sharded there, outside the forward of "
            f"the module owning it (a head tied by F.linear(x, self.wte.weight), a weight read before its module "
            f"runs, an update from one encoder to another): {_FIX}. PyTorch said: {text.splitlines()[0]}")
    if _WRITTEN_VIEW in text:
        return UnitBoundaryError(
            f"{module_type}'s forward wrote in place to the input or output of a unit (x += block(x)), which "
            f"FSDP2's backward hooks hand over as views: {_FIX}")
    return None


def users_class_name(cls: type) -> str:
    """The name of the class the user wrote, under the subclasses FSDP2 and osdp made of it."""
    made = ("torch.distributed", "osdp")
    return next((c.__name__ for c in cls.__mro__ if not c.__module__.startswith(made)), cls.__name__)


def explaining(cls: type) -> Callable:
    """The forward of the module class ``cls``, raising ``UnitBoundaryError`` for the errors above; its
    signature kept (Hugging Face's Trainer reads it to choose the batch's columns)."""
    forward, name = cls.forward, users_class_name(cls)

    @functools.wraps(forward)
    def explained_forward(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        except UnitBoundaryError:
            raise
        except RuntimeError as e:
            clearer = explained(e, name)
            if clearer is None:
                raise
            raise clearer from e

    return explained_forward


def double_backward_error(unit_path: str) -> UnitBoundaryError:
    return UnitBoundaryError(
        f"a backward with create_graph=True (a gradient penalty, a second-order step) went through unit "
        f"'{unit_path}', which FSDP2 holds under this plan (sharded, or replicated in bf16): FSDP2 frees its "
        "gathered parameters as that backward ends, and the graph it created needs them in its own backward. "
        "Units the plan replicates in fp32 keep them: give the units such a backward goes through mode "
        "'replicate' in an fp32 plan (osdp.wrap(model, strategy='ddp') replicates all), or compute the penalty "
        "without create_graph")


def dtensor_loss_error() -> UnitBoundaryError:
    return UnitBoundaryError(
        "the loss combined the model's output with DTensors: parameters read between forward and backward (a "
        "regulariser loss + sum(p.square().sum() for p in model.parameters())) are the ranks' DTensor shards "
        "where the plan frees a unit's gathered parameters after forward (zero3, split), as under FSDP2. Compute "
        "such a term in the model's forward, where every plan has gathered them, or use the optimizer's "
        "weight_decay")


def refuse_dtensor_gradients_into_outputs(model: torch.nn.Module) -> None:
    """Raise ``dtensor_loss_error`` as a backward begins if the gradient reaching a plain output of ``model``'s
    forward is a DTensor (the loss mixed a DTensor into it): every rank at the same point, before the units'
    gradients are reduced."""

    def check(grad):
        if isinstance(grad, DTensor):
            raise dtensor_loss_error()
        return grad

    def hook(_module, _args, output):
        if torch.is_grad_enabled():
            for t in output_tensors(output):
                if t.requires_grad and not isinstance(t, DTensor):
                    t.register_hook(check)
        return output

    model.register_forward_hook(hook)


def returned_gradient_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"torch.autograd.grad asked for the gradient of parameter '{name}' of a wrapped model: gradients are "
        "averaged over the ranks (to what one process training the whole batch computes) only as a backward "
        "accumulates them into .grad, as under DistributedDataParallel and FSDP2, so each rank would get its own. "
        "Call loss.backward() and read p.grad (p.grad.full_tensor() where it is a DTensor shard), or take "
        "torch.autograd.grad with respect to inputs (a gradient penalty), not parameters")


def refuse_returned_gradients(param: torch.Tensor, name: str) -> Callable:
    """A gradient hook for ``param`` making ``torch.autograd.grad`` raise ``returned_gradient_error`` where it
    computes its gradient to return it. Raised as that backward ends, after FSDP2's and the reducer's own ends
    (queued before): every unit has finished its backward, so the model trains on if the user goes on with a
    backward. Holds ``param`` weakly: autograd keeps a tensor's hooks where the garbage collector cannot see them."""
    ref = weakref.ref(param)

    def hook(grad):
        task = torch._C._current_graph_task_id()
        if task != _last_task[0]:  # asked once per backward: it returns all the gradients it computes, or none
            p = ref()
            _last_task[:] = [task, p is not None and gradient_returned_not_accumulated(p)]
            if _last_task[1]:
                queue_at_backward_end(functools.partial(_refuse_returned_gradient, name))
        return grad

    return hook


_last_task: list = [None, False]  # the backward (graph task) a hook last ran in; whether it returns gradients


def _refuse_returned_gradient(name: str) -> None:
    raise returned_gradient_error(name)
