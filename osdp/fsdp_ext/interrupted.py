"""A step an exception cut short: the next forward starts clean, under every plan.

An exception raised inside a backward (CUDA out of memory, a hook of the user's, osdp's own refusals) leaves it
unfinished: FSDP2's end-of-backward callback and the reducer's never run, so units stay gathered and the next
backward would reduce nothing. Loops catch such exceptions and go on: fairseq skips a batch that ran out of
memory, accelerate's ``find_executable_batch_size`` and Lightning's batch size finder retry with a smaller one.
FSDP2 asks for ``model.reset_iter_state()`` on the root after the catch (a wrapped model's reaches the
replicated units too, ``fsdp_ext.module_api``); the root's next forward calls it where a backward was cut short
and nobody did, so the step after trains as on one process: what the failed backward had accumulated stays or
goes with the user's ``zero_grad``, as there.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from osdp._torch_private import fsdp_backward_cut_short


def start_clean_after_a_backward_cut_short(model: nn.Module, reducer) -> None:
    """Make ``model``'s forward (the ``fully_shard``-ed root) reset every unit's per-step state first where the
    last backward raised before its end (``reducer``: the model's ``ReplicaReducer``, or None)."""

    @torch._dynamo.disable
    def reset_if_cut_short(module: nn.Module, *_) -> None:
        if fsdp_backward_cut_short(module) or (reducer is not None and reducer.cut_short):
            module.reset_iter_state()

    model.register_forward_pre_hook(reset_if_cut_short, prepend=True)
