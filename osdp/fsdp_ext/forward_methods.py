"""Methods registered with ``register_fsdp_forward_method`` run osdp's hooks with FSDP2's, as ``forward`` does.

A model whose training loop calls a method rather than ``forward`` (``model.training_loss(x)``, a VAE's
``encode`` and ``decode``, ``generate``) registers it with FSDP2 as a forward method: FSDP2 then runs its own
pre- and post-forward around each call, gathering and freeing the unit's parameters. osdp hooks the same
points of each unit (the replicated parameters made plain for computing and the reducer armed, prefetching,
the budget's first step): without them a replicated unit would compute with its at-rest DTensor views and a
plan's reducer would never reduce. So each unit's FSDP2 state is given a pre- and post-forward that run, in
the order ``forward`` runs them, FSDP2's own and osdp's hooks on the module; the user's own module hooks stay
out, as FSDP2 leaves them out of a registered method.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from osdp._torch_private import fsdp_forward_method_hooks, set_fsdp_forward_method_hooks
from osdp.describe.kept import defined_by_osdp


def run_osdp_hooks_in_forward_methods(unit: nn.Module) -> None:
    """``unit`` (``fully_shard``-ed): its registered forward methods run osdp's hooks too (module docstring)."""
    fsdp_pre, fsdp_post, is_fsdps = fsdp_forward_method_hooks(unit)

    def pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ran_fsdps = False
        for key, hook in list(module._forward_pre_hooks.items()):
            if is_fsdps(hook):
                args, kwargs, ran_fsdps = *fsdp_pre(module, args, kwargs), True
            elif defined_by_osdp(hook):
                if key in module._forward_pre_hooks_with_kwargs:
                    result = hook(module, args, kwargs)
                    if result is not None:
                        args, kwargs = result
                else:
                    result = hook(module, args)
                    if result is not None:
                        args = result if isinstance(result, tuple) else (result,)
        if not ran_fsdps:  # a group's hooks are wrappers of FSDP2's: run its own, as the method would
            args, kwargs = fsdp_pre(module, args, kwargs)
        return args, kwargs

    def post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
        ran_fsdps = False
        for hook in list(module._forward_hooks.values()):
            if is_fsdps(hook):
                output, ran_fsdps = fsdp_post(module, args, output), True
            elif defined_by_osdp(hook):  # osdp registers no forward hook taking keyword arguments
                result = hook(module, args, output)
                if result is not None:
                    output = result
        return output if ran_fsdps else fsdp_post(module, args, output)

    set_fsdp_forward_method_hooks(unit, pre_forward, post_forward)
