"""Optimizer state laid out as its parameter is, whatever plan it was saved under.

A plan is chosen by a budget the user may change between runs (and by what the machine measured), so the
``optimizer.state_dict()`` each rank saved under one plan may be loaded into an optimizer over another plan's
parameters. PyTorch's ``load_state_dict`` casts each value to its parameter's dtype and device and keeps its
layout: a sharded parameter's moments arrive as the full plain tensors its replicated self had (or a replicated
one's as another plan's shards), and the step fails in DTensor's dispatch. Before the first step of every
optimizer, and the first after each ``load_state_dict``, each state tensor of its parameter's global shape is
brought to the layout the step computes in (``osdp.distributed.layouts.in_layout_of``; a replicated parameter's
plain memory where torch's optimizers step that, ``fsdp_ext.replicated_view``). Shards laid out otherwise are
gathered there, a collective every rank takes part in, as every rank steps; ``osdp.runtime.dcp`` saves and loads
the same state under any plan and number of ranks without a rank's own file.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from osdp.distributed.layouts import in_layout_of
from osdp.fsdp_ext.replicated_view import steps_each_parameter_alone

_PENDING_ATTR = "_osdp_state_layout_pending"  # on an optimizer: False once its state is known to be laid out
_hook = None


def lay_out_loaded_optimizer_state() -> None:
    """Install the step pre-hook (once per process)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_lay_out_state)


def _lay_out_state(optimizer: torch.optim.Optimizer, *_) -> None:
    pending = optimizer.__dict__.get(_PENDING_ATTR)
    if pending is False:
        return  # the common case: checked, and nothing loaded since
    if pending is None:  # first seen: every later load_state_dict marks it again
        optimizer.register_load_state_dict_post_hook(_mark_pending)
    optimizer.__dict__[_PENDING_ATTR] = False
    plain = steps_each_parameter_alone(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            # a replicated parameter's view is stepped in its plain memory (in whichever order the hooks run)
            computed_in = getattr(param, "_osdp_plain", None) if plain else None
            computed_in = param if computed_in is None else computed_in
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
                    state[key] = in_layout_of(computed_in, value)


def _mark_pending(optimizer: torch.optim.Optimizer) -> None:
    optimizer.__dict__[_PENDING_ATTR] = True
