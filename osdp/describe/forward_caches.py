"""Forward caches off while a checkpointed model trains, as Hugging Face's own checkpointing does.

A model whose forward keeps state across calls (a Transformers decoder's
key/value cache, on by default: ``config.use_cache=True``) saves a different
set of tensors when a checkpointed unit recomputes its forward, and the first
backward fails (``CheckpointError: A different number of tensors was saved``).
Transformers turns the cache off for training under its gradient
checkpointing, with a warning; a plan that checkpoints units does the same
here: every outermost module that takes ``use_cache`` and is configured with
it on is called with ``use_cache=False`` while it trains with gradients
enabled. Evaluation and generation (``eval()`` or ``torch.no_grad()``) keep
the cache, and ``config`` is left as the user had it.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from osdp.schema.plan import display_path


def _takes_use_cache(module: nn.Module) -> bool:
    if getattr(getattr(module, "config", None), "use_cache", None) is not True:
        return False
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature
        return False


def _within(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def cached_modules(model: nn.Module) -> list[str]:
    """Paths of the outermost modules configured to keep a forward cache (``config.use_cache`` on)."""
    paths: list[str] = []
    for path, module in model.named_modules():  # parents before children
        if not any(_within(path, p) for p in paths) and _takes_use_cache(module):
            paths.append(path)  # modules inside it get use_cache from it
    return paths


def disable_caches_in_training(model: nn.Module, *, warn: bool = True) -> list[RemovableHandle]:
    """Call every module ``cached_modules`` finds with ``use_cache=False`` while it trains.

    Returns the hooks' handles (``remove()`` restores the model). With ``warn``,
    the first training forward that turns a cache off warns once, naming the
    modules and why.
    """
    paths = cached_modules(model)
    warned = not warn

    def no_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        nonlocal warned
        if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
            if not warned:
                warned = True
                names = ", ".join(display_path(p) for p in paths)
                warnings.warn(
                    f"osdp: use_cache=True cannot be trained with activation checkpointing (a recomputed "
                    f"forward would save other tensors): {names} called with use_cache=False while training; "
                    f"eval() and torch.no_grad() keep the cache", stacklevel=2,
                )
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    modules = dict(model.named_modules())
    return [modules[p].register_forward_pre_hook(no_cache, with_kwargs=True) for p in paths]
