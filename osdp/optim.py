"""The optimizers osdp plans for, built the way training builds them.

The cost model prices the optimizer's state and step by name
(``osdp.cost.terms.OPTIMIZER_STATES``); ``make_optimizer`` is the one place that
turns such a name into a ``torch.optim`` optimizer, so that what is trained,
timed by the profiler and priced are the same thing.
"""

from __future__ import annotations

from typing import Iterable

import torch

OPTIMIZERS = ("sgd", "sgd-momentum", "adamw")


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float = 1e-3) -> torch.optim.Optimizer:
    """``name`` (one of ``OPTIMIZERS``) over ``params``, with PyTorch's default implementation choice."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; osdp knows {list(OPTIMIZERS)}")


__all__ = ["OPTIMIZERS", "make_optimizer"]
