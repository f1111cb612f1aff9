"""Methods registered with ``register_fsdp_forward_method`` run osdp's hooks with FSDP2's, as ``forward`` does.

A model whose training loop calls a method rather than ``forward`` (``model.training_loss(x)``, a VAE's
``encode`` and ``decode``, ``generate``) registers it with FSDP2 as a forward method: FSDP2 then runs its own
pre- and post-forward around each call, gathering and freeing the unit's parameters. osdp hooks the same
points of each unit (the replicated parameters made plain for computing and the reducer armed, prefetching):
without them a replicated unit would compute with its at-rest DTensor views, and its reducer never reduce.

``register_fsdp_forward_method`` sets the method on the module; a unit (``module_api.UnitModule``) sees it set
and sets in its place a method running osdp's pre-forward hooks on the module, then FSDP2's method, then osdp's
forward hooks: the order of a call of ``forward``, whose hooks osdp registered before (pre-forward) and after
(forward) FSDP2's. The user's own module hooks stay out, as FSDP2 leaves them out of a registered method, and
FSDP2's state is left as it is (``FSDPMemTracker`` instruments it).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch.nn as nn

from osdp.describe.kept import defined_by_osdp

def registered_by_fsdp2(value: Any) -> bool:
    """Whether ``value`` is a method ``register_fsdp_forward_method`` made (its code's, not the method it wraps,
    whose name and module ``functools.wraps`` copied onto it)."""
    code = getattr(getattr(value, "__func__", None), "__code__", None)
    return (isinstance(value, types.MethodType) and code is not None and code.co_name == "wrapped_method"
            and "_fully_shard" in code.co_filename)


def with_osdp_hooks(method: types.MethodType) -> types.MethodType:
    """FSDP2's registered ``method`` of a unit, running osdp's hooks on the unit around it (module docstring)."""

    @functools.wraps(method)
    def hooked(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _osdp_pre_forward(module, args, kwargs)
        return _osdp_forward(module, args, method(*args, **kwargs))

    return types.MethodType(hooked, method.__self__)


def _osdp_pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    for key, hook in list(module._forward_pre_hooks.items()):
        if not defined_by_osdp(hook):
            continue
        if key in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _osdp_forward(module: nn.Module, args: tuple, output: Any) -> Any:
    for hook in list(module._forward_hooks.values()):
        if defined_by_osdp(hook):  # osdp registers no forward hook taking keyword arguments
            result = hook(module, args, output)
            if result is not None:
                output = result
    return output
