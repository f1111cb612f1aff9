"""Activation checkpointing of a unit, one way for the plans that train and the profiler that measures them.

Two policies (``CHECKPOINT_POLICIES``, besides "none"):

* ``full``: the unit's forward runs under non-reentrant ``torch.utils.checkpoint``; backward redoes all of it.
* ``selective``: the same, with a per-op policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``,
  as torchtitan's default per-op checkpointing): the outputs of the expensive ops (``SAVED_OPS``: matmuls,
  attention, convolutions) are kept, everything else (norms, activations, dropout, pointwise) is recomputed.
  It keeps more than ``full`` (the matmuls' outputs) and redoes much less (no matmul is done twice).

The module's hooks (FSDP2's gathers and reshards) stay outside the checkpoint, as torchtitan's
``checkpoint_wrapper`` inside ``fully_shard``. The module's class is swapped for a subclass whose ``forward``
is the class's under checkpoint (as ``fully_shard`` swaps in its ``FSDP<cls>``), so module paths and
state-dict keys stay, deep copies stay independent, and ``torch.compile`` over the whole model traces each
checkpointed unit as one checkpointed region (hooks that enter and leave a checkpoint, as
``torch.distributed._composable``'s, cannot be traced that way).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from osdp.schema.plan import CHECKPOINT_POLICIES

_aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: the matmuls (a Linear is an mm or addmm on the
# dispatcher), attention (each backend's op: CPU, flash, memory-efficient, cuDNN), convolutions.
SAVED_OPS = frozenset(
    getattr(getattr(_aten, name), "default")
    for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name)
)


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of a selectively checkpointed forward (a fresh pair of contexts per call)."""
    return create_selective_checkpoint_contexts(_keep_expensive)


_CHECKPOINTED: dict[tuple[type, str], type] = {}  # (class, policy) -> its checkpointed subclass
_ORIGINAL: dict[type, tuple[type, str]] = {}  # and back: (class, policy)


def checkpoint_unit(module: nn.Module, policy: str = "full") -> None:
    """From now on ``module``'s forward is recomputed in backward (``policy`` "full"), or all of it but its
    matmuls' and attention's outputs ("selective"), instead of saving its activations."""
    if policy not in CHECKPOINT_POLICIES[1:]:
        raise ValueError(f"checkpoint policy {policy!r} does not exist; use one of {CHECKPOINT_POLICIES[1:]}")
    cls = type(module)
    if cls in _ORIGINAL:
        if _ORIGINAL[cls][1] == policy:
            return  # already so
        cls = _ORIGINAL[cls][0]
    if (cls, policy) not in _CHECKPOINTED:
        context = {"context_fn": selective_context} if policy == "selective" else {}

        @functools.wraps(cls.forward)  # its signature too: callers inspect it (the Trainer picks dataset columns by it)
        def forward(self, *args, **kwargs):
            # the unit's keyword arguments go to it through a closure: passed on, checkpoint() would take the
            # ones it knows as its own (a forward's ``debug=True`` would set checkpoint's debug mode)
            def run(*args):
                return cls.forward(self, *args, **kwargs)

            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **context)

        prefix = "SelectivelyCheckpointed" if policy == "selective" else "Checkpointed"
        checkpointed = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[(cls, policy)], _ORIGINAL[checkpointed] = checkpointed, (cls, policy)
    module.__class__ = _CHECKPOINTED[(cls, policy)]


def checkpoint_policy(module: nn.Module) -> str:
    """"none", "selective" or "full": how ``checkpoint_unit`` left ``module`` (a class swapped since, as
    ``fully_shard`` swaps, is looked through)."""
    for c in type(module).__mro__:
        if c in _ORIGINAL:
            return _ORIGINAL[c][1]
    return "none"


def is_checkpointed(module: nn.Module) -> bool:
    return checkpoint_policy(module) != "none"


def undo_checkpoint(module: nn.Module) -> None:
    """``module`` saves its activations again (only a module ``checkpoint_unit`` changed, and nothing
    swapped its class since)."""
    module.__class__ = _ORIGINAL[type(module)][0]
