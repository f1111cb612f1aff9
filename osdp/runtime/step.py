"""The training step, one way for every loop osdp runs: ``osdp train``, the jobs that the calibration and
the validation time side by side, the calibration's fixed step, and the experiments.

A step is the forward (``describe.batch.call_model``: a tensor is one argument, a tuple positional ones, a
dict keyword ones), the loss (``loss_of``: the output itself, ``output.loss``, or ``loss_fn(output)``),
the backward, the optimizer's step and the gradients set to None, timed from a synchronised start to a
synchronised end (``machine.timing.StepTimer``) with the end of backward marked. What the planner priced
is exactly this step: the describe times the same forward and backward and the optimizer by the same name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from osdp.describe.batch import call_model, loss_of
from osdp.machine.memory import PeakMemory, iter_tensors
from osdp.machine.timing import StepTimer


@dataclass
class StepTimes:
    loss: torch.Tensor  # not synchronised: ``.item()`` it when the value is wanted
    seconds: float  # the whole step
    fwd_bwd_seconds: float  # to the end of backward


def train_step(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer, *,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               device: torch.device | str = "cpu") -> StepTimes:
    """One timed training step of ``model`` on ``batch`` (see the module docstring)."""
    with StepTimer(device) as timer:
        loss = loss_of(call_model(model, batch), loss_fn)
        loss.backward()
        fwd_bwd = timer.lap()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepTimes(loss.detach(), timer.seconds, fwd_bwd)


def peaks_per_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, warmup: int = 2,
                   steps: int = 3) -> list[int]:
    """Peak bytes of each of ``steps`` training steps on CPU (``machine.memory.PeakMemory``), after ``warmup``
    untracked ones (the optimizer's state exists by then, and DDP rebuilds its buckets in its second
    iteration)."""
    peaks = []
    for step in range(warmup + steps):
        meter = PeakMemory("cpu", model, optimizer, *iter_tensors(batch))
        with meter if step >= warmup else contextlib.nullcontext():
            train_step(model, batch, optimizer, loss_fn=loss_fn)
        if step >= warmup:
            peaks.append(meter.stats().peak_bytes)
    return peaks
