"""The step timer: wall-clock seconds of a training step, synchronised with the device.

CUDA kernels run asynchronously, so a step is timed from a synchronised start
to a synchronised end (and a mark inside it, such as the end of backward, is
synchronised too). On CPU the synchronisation is free. Every step time osdp
reports (``osdp train``, the validation and the experiments) comes from here.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """``with StepTimer(device) as t: ...``; then ``t.seconds``. ``t.lap()`` inside: seconds so far.

    Example::

        with StepTimer(device) as t:
            model(x).sum().backward()
            fwd_bwd_s = t.lap()
            optimizer.step()
        step_s = t.seconds
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seconds = float("nan")

    def __enter__(self) -> "StepTimer":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def lap(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self._start

    def __exit__(self, *exc: Any) -> None:
        self.seconds = self.lap()


__all__ = ["StepTimer", "synchronize"]
