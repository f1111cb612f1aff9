"""FSDP2's mixed precision kept right under what training scripts do with a plan's units.

A bf16 plan runs every unit under FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduction), and
FSDP2 breaks there in two ways a plan can expose where plain ``fully_shard`` of a model's blocks rarely
does, since osdp makes every module holding parameters a unit:

* a unit all of whose parameters were frozen at the first forward and are unfrozen later (fine-tuning
  that unfreezes a part) keeps no reduce dtype: its bf16 gradients are reduced in bf16 and cannot be
  assigned to its fp32 parameters. Before each training forward such units get their dtypes set again;
* a unit no forward has called yet (a head used only in some steps) is never gathered, and with gradient
  sync off (accumulation) FSDP2's final callback reads its unsharded parameters, which do not exist. Its
  post-backward is skipped: it has nothing to reduce or accumulate.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from osdp._torch_private import fsdp_refresh_reduce_dtype, fsdp_skip_post_backward_if_never_gathered


def keep_mixed_precision_current(model: nn.Module) -> None:
    """Install both repairs on every FSDP2 unit of a wrapped ``model`` (a bf16 plan's)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        fsdp_skip_post_backward_if_never_gathered(unit)

    def refresh(module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            for unit in units:
                fsdp_refresh_reduce_dtype(unit)

    model.register_forward_pre_hook(refresh, prepend=True)
