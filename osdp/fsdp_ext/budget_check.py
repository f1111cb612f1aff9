"""The budget is a promise: a searched plan's first training step is measured, and a step over the budget warns.

``osdp.wrap(model, device_mem=...)`` installs this on the wrapped model. The
first training forward (gradients enabled) starts a ``osdp.machine.memory.PeakMemory``
(CUDA: ``torch.cuda.max_memory_allocated``; CPU: the live-bytes tracker), the
end of the first optimizer step over the model's parameters (or, if none
comes, the next training forward) stops it, and a peak over the budget warns
on that rank, with the figures and what to do. Then the check removes itself:
later steps run untouched.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from osdp.machine.memory import PeakMemory
from osdp.sizes import format_bytes


class BudgetExceededWarning(UserWarning):
    """A training step of a searched plan measured more memory than the budget it was searched for."""


class FirstStepCheck:
    def __init__(self, model: nn.Module, device: torch.device, budget_bytes: int, predicted_bytes: int):
        self.device, self.budget, self.predicted = device, budget_bytes, predicted_bytes
        self.model_params = {id(p) for p in model.parameters()}
        self.meter: PeakMemory | None = None
        self.model = model
        self.measured: int | None = None
        # before FSDP2's own pre-forward, so that the root's gathered parameters are counted
        self._forward = model.register_forward_pre_hook(self._on_forward, prepend=True)
        self._step = None

    @torch._dynamo.disable  # a model compiled before wrapping calls it inside its frame: bookkeeping, not traced
    def _on_forward(self, _module, _args) -> None:
        if not (torch.is_grad_enabled() and self.model.training):
            return
        if self.meter is not None:  # a second training forward and no optimizer step between: stop here
            self._finish()
            return
        # entered inside the forward: no saved-tensors hook (only the total is needed, not the activations apart)
        self.meter = PeakMemory(self.device.type if self.device.type == "cpu" else self.device, self.model,
                                saved_tensors=False)
        self.meter.__enter__()
        self._step = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer: torch.optim.Optimizer, *_) -> None:
        if any(id(p) in self.model_params for group in optimizer.param_groups for p in group["params"]):
            self._finish()

    def _finish(self) -> None:
        self._forward.remove()
        if self._step is not None:
            self._step.remove()
        if self.meter is None:
            return
        self.meter.__exit__(None, None, None)
        self.measured = self.meter.stats().peak_bytes
        self.meter = None
        if self.measured > self.budget:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            over = self.measured - self.budget
            warnings.warn(
                f"osdp: rank {rank}'s first training step peaked at {format_bytes(self.measured)}, "
                f"{format_bytes(over)} ({over / self.budget:.1%}) over the budget of {format_bytes(self.budget)} "
                f"the plan was searched for (it predicted {format_bytes(self.predicted)}). Wrap with a device_mem "
                f"lower by at least {format_bytes(over)} to stay within {format_bytes(self.budget)}, or train a "
                "smaller micro-batch than the example's", BudgetExceededWarning, stacklevel=2,
            )


def check_first_step(model: nn.Module, device: torch.device, budget_bytes: int, predicted_bytes: int) -> FirstStepCheck:
    """Measure ``model``'s first training step against ``budget_bytes`` (see the module docstring)."""
    return FirstStepCheck(model, device, budget_bytes, predicted_bytes)
