"""Activation checkpointing of a unit, one way for the plans that train and the profiler that measures them.

A checkpointed unit's forward runs under non-reentrant ``torch.utils.checkpoint``
with the module's hooks (FSDP2's gathers and reshards) outside it, as
torchtitan's ``checkpoint_wrapper`` inside ``fully_shard``. The module's class
is swapped for a subclass whose ``forward`` is the class's under checkpoint
(as ``fully_shard`` swaps in its ``FSDP<cls>``), so module paths and state-dict
keys stay, deep copies stay independent, and ``torch.compile`` over the whole
model traces each checkpointed unit as one checkpointed region (hooks that
enter and leave a checkpoint, as ``torch.distributed._composable``'s, cannot be
traced that way).
"""

from __future__ import annotations

import functools

import torch.nn as nn
import torch.utils.checkpoint

_CHECKPOINTED: dict[type, type] = {}  # class -> its checkpointed subclass
_ORIGINAL: dict[type, type] = {}  # and back


def checkpoint_unit(module: nn.Module) -> None:
    """From now on ``module``'s forward is recomputed in backward instead of saving its activations."""
    cls = type(module)
    if cls in _ORIGINAL:
        return  # already checkpointed
    if cls not in _CHECKPOINTED:

        @functools.wraps(cls.forward)  # its signature too: callers inspect it (the Trainer picks dataset columns by it)
        def forward(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        checkpointed = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[cls], _ORIGINAL[checkpointed] = checkpointed, cls
    module.__class__ = _CHECKPOINTED[cls]


def is_checkpointed(module: nn.Module) -> bool:
    return any(c in _ORIGINAL for c in type(module).__mro__)


def undo_checkpoint(module: nn.Module) -> None:
    """``module`` saves its activations again (only a module ``checkpoint_unit`` changed, and nothing
    swapped its class since)."""
    module.__class__ = _ORIGINAL[type(module)]
