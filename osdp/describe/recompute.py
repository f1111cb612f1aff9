"""Activation checkpointing of a unit, one way for the plans that train and the profiler that measures them.

Two policies (``CHECKPOINT_POLICIES``, besides "none"):

* ``full``: the unit's forward runs under non-reentrant ``torch.utils.checkpoint``; backward redoes all of it.
* ``selective``: the same, with torchtitan's default per-op policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the expensive ops
  (``SAVED_OPS``: attention, convolutions, batched matmuls, and every other matmul of the unit's forward,
  ``MATMULS`` counted in order) are kept, everything else (the other matmuls, norms, activations, dropout,
  pointwise) is recomputed. It keeps more than ``full`` and redoes much less. Skipping every second matmul
  drops what keeping them all would waste: in a unit of two (an attention's or an MLP's), the second's
  output is the unit's output, which no backward formula needs, so the recompute never reaches it; in a
  transformer block of four, the attention's projection is done again. With this policy OSDP's selective
  plans are the plans experts run (FSDP2 or DDP with torchtitan's selective checkpointing of every block).

The module's hooks (FSDP2's gathers and reshards) stay outside the checkpoint, as torchtitan's
``checkpoint_wrapper`` inside ``fully_shard``. The module's class is swapped for a subclass whose ``forward``
is the class's under checkpoint (as ``fully_shard`` swaps in its ``FSDP<cls>``), so module paths and
state-dict keys stay, deep copies stay independent, and ``torch.compile`` over the whole model traces each
checkpointed unit as one checkpointed region (hooks that enter and leave a checkpoint, as
``torch.distributed._composable``'s, cannot be traced that way).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from osdp._torch_private import (
    outside_dispatch_modes,
    outside_selective_checkpointing,
    selective_contexts_read_again,
)
from osdp.describe.kept import defined_by_fsdp, defined_by_torch, fingerprint
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


# A Linear's matmul on the dispatcher: of these, selective checkpointing keeps every other one's output.
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})


def kept_by_selective(op, matmuls_so_far: int) -> bool:
    """Whether selective checkpointing keeps the output of ``op``, the checkpointed forward's
    ``matmuls_so_far``-th matmul if it is one (this one counted): the expensive ops', but every second
    matmul's."""
    return op in SAVED_OPS and not (op in MATMULS and matmuls_so_far % 2 == 0)


def selective_context():
    """The ``context_fn`` of a selectively checkpointed forward: a fresh pair of contexts per call, counting the
    matmuls of the forward and of its recompute apart, so that both keep the same ones."""
    matmuls = {False: 0, True: 0}  # ctx.is_recompute -> matmuls so far

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            matmuls[ctx.is_recompute] += 1
        if kept_by_selective(op, matmuls[ctx.is_recompute]):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return selective_contexts_read_again(create_selective_checkpoint_contexts(policy))


_CHECKPOINTED: dict[tuple[type, str], type] = {}  # (class, policy) -> its checkpointed subclass
_ORIGINAL: dict[type, tuple[type, str]] = {}  # and back: (class, policy)


def checkpoint_unit(module: nn.Module, policy: str = "full") -> None:
    """From now on ``module``'s forward is recomputed in backward (``policy`` "full"), or all of it but the
    outputs of its attention and every other matmul ("selective"), instead of saving its activations."""
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
            written: list[torch.Tensor] | None = None  # the buffers the forward wrote (None: it has not run)
            hooks = _InnerHooks(self)

            # the unit's keyword arguments go to it through a closure: passed on, checkpoint() would take the
            # ones it knows as its own (a forward's ``debug=True`` would set checkpoint's debug mode); and each
            # tensor once, as a recompute inside another's (a unit in a checkpointed unit) unpacks every argument
            # apart, and a forward may test them for identity (self-attention's ``query is key``)
            distinct, positions = _distinct_tensors(args)

            def run(*distinct):
                nonlocal written
                given = tuple(distinct[i] if i is not None else a for i, a in zip(positions, args))
                if written is None:
                    versions = [(b, b._version) for b in self.buffers()]
                    check = _checks_values(self)
                    weights = [(n, p, p._version, fingerprint(p) if check and _plain(p) else None)
                               for n, p in self.named_parameters()]
                    with hooks.recording():
                        out = cls.forward(self, *given, **kwargs)
                    written = _running_statistics(self) + [b for b, version in versions if b._version != version]
                    _refuse_written_weights(cls, [n for n, p, version, values in weights
                                                  if p._version != version or _values_changed(p, values)])
                    _refuse_written_buffers(cls, self, [b for b, version in versions if b._version != version])
                    return out
                with hooks.replaying():
                    return _recompute(written, lambda: cls.forward(self, *given, **kwargs))

            return torch.utils.checkpoint.checkpoint(run, *distinct, use_reentrant=False, **context)

        # named as the user's class: the plan is not to be seen in ``type(model).__name__`` (Hugging Face's
        # save_pretrained writes it into config.json, with FSDP2's "FSDP" prefix taken off) or the model's repr
        checkpointed = type(cls.__name__, (cls,), {"forward": forward, "__qualname__": cls.__qualname__})
        _CHECKPOINTED[(cls, policy)], _ORIGINAL[checkpointed] = checkpointed, (cls, policy)
    module.__class__ = _CHECKPOINTED[(cls, policy)]


def _distinct_tensors(args: tuple) -> tuple[list, list[int | None]]:
    """The arguments as given once each (tensors by identity, everything else by position), and for each
    argument its index in that list (None: not a tensor, passed as it was)."""
    distinct: list = []
    seen: dict[int, int] = {}
    positions: list[int | None] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if id(a) not in seen:
                seen[id(a)] = len(distinct)
                distinct.append(a)
            positions.append(seen[id(a)])
        else:
            positions.append(None)
    return distinct, positions


class _InnerHooks:
    """The forward hooks of the modules inside a checkpointed unit, run by its recompute as the forward ran them,
    but only where they changed something: a call that returned an input or output (a hook that scales, masks or
    casts) is run again, as the recompute must compute what the forward did; one that returned nothing (counting
    calls, collecting activations, logging) saw the forward already, and would see each call twice, under this
    plan only. The unit's own hooks (FSDP2's among them) stay outside the checkpoint and run once anyway."""

    def __init__(self, unit: nn.Module):
        self.unit = unit
        self.returned: dict[tuple[int, int], list[bool]] = {}  # (hook dict, handle id) -> per call, returned?

    def _hooked(self):
        for name, m in self.unit.named_modules():
            if name:
                for hooks in (m._forward_pre_hooks, m._forward_hooks):
                    for key, hook in list(hooks.items()):
                        yield hooks, key, hook

    @contextlib.contextmanager
    def _swapped(self, wrap):
        swapped = [(hooks, key, hook) for hooks, key, hook in self._hooked()]
        for hooks, key, hook in swapped:
            hooks[key] = wrap((id(hooks), key), _unseen_by_selective(hook) if defined_by_fsdp(hook) else hook)
        try:
            yield
        finally:
            for hooks, key, hook in swapped:
                if key in hooks:  # not removed meanwhile
                    hooks[key] = hook

    def recording(self):
        self.returned = {}

        def wrap(slot, hook):
            def recorded(*args, **kwargs):
                result = hook(*args, **kwargs)
                self.returned.setdefault(slot, []).append(result is not None)
                return result
            return recorded

        return self._swapped(wrap)

    def replaying(self):
        calls = {slot: iter(returned) for slot, returned in self.returned.items()}

        def wrap(slot, hook):
            # torch's own hooks compute what the module runs even where they return nothing: prune's and the old
            # weight_norm's forward pre-hooks set the module's ``weight`` from its parts, which the recompute must
            # compute again as the forward did
            always = defined_by_torch(hook)

            def replayed(*args, **kwargs):
                if next(calls.get(slot, iter(())), True) or always:
                    return hook(*args, **kwargs)
                return None
            return replayed

        return self._swapped(wrap)


def _unseen_by_selective(hook):
    """An FSDP2 hook of a unit nested in the checkpointed one, its ops hidden from selective checkpointing: they
    gather and free that unit's parameters as FSDP2's state says, which differs between the forward and the
    recompute in backward (a unit called once under no_grad and once with grad gathers twice in the forward, once
    in the recompute), and selective checkpointing matches the two op by op."""

    @functools.wraps(hook)
    def unseen(*args, **kwargs):
        with outside_selective_checkpointing():
            return hook(*args, **kwargs)
    return unseen


_CHECKED_FORWARDS = 2  # training forwards whose weights' values are compared too


def _checks_values(unit: nn.Module) -> bool:
    """A weight written through ``p.data`` (older code's momentum updates and decays) bumps no version: in the
    unit's first ``_CHECKED_FORWARDS`` training forwards its weights' values are compared as well, one read of
    each."""
    checked = unit.__dict__.get("_osdp_forwards_checked", 0)
    if not torch.is_grad_enabled() or checked >= _CHECKED_FORWARDS:
        return False
    unit.__dict__["_osdp_forwards_checked"] = checked + 1
    return True


def _plain(p: torch.Tensor) -> bool:
    """A weight with values here: not a split Linear's shard (a DTensor), nor a fake or meta tensor (a describe
    of shapes)."""
    return type(p.data) is torch.Tensor and p.device.type != "meta"


def _values_changed(p: torch.Tensor, values: tuple[float, float] | None) -> bool:
    return values is not None and fingerprint(p) != values


def _refuse_written_weights(cls: type, names: list[str]) -> None:
    # A recompute would start from the weights the forward wrote and differentiate another computation than the
    # forward's. Raised on every rank alike: each runs the same forward.
    if names:
        raise RuntimeError(
            f"{cls.__name__}'s forward writes its parameter(s) {', '.join(names[:3])} in place, so it "
            "cannot be checkpointed: the recompute in backward would start from what the forward wrote. Give its "
            "unit checkpoint=False in the plan (a searched plan never checkpoints such a unit)"
        )


def _refuse_written_buffers(cls: type, unit: nn.Module, written: list[torch.Tensor]) -> None:
    # A buffer the forward wrote and may read (spectral_norm's power iteration advancing ``_u`` and ``_v``, a
    # counter a forward branches on): the recompute would start from the written value and compute another
    # output than the forward's, which backward would then differentiate. Normalization layers' statistics are
    # written and not read in training. The describe keeps a searched plan from checkpointing such a unit
    # (``InPlaceWrites.state_written``); a hand-written plan is refused here, on every rank alike.
    statistics = {id(b) for b in statistics_buffers(unit)}
    names = {id(b): n for n, b in unit.named_buffers()}
    written = [names[id(b)] for b in written if id(b) not in statistics and id(b) in names]
    if written:
        raise RuntimeError(
            f"{cls.__name__}'s forward writes its buffer(s) {', '.join(written[:3])} in place, so it cannot be "
            "checkpointed: the recompute in backward would start from what the forward wrote (spectral_norm's power "
            "iteration, a step counter). Give its unit checkpoint=False in the plan (a searched plan never "
            "checkpoints such a unit)"
        )


def statistics_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Normalization layers' buffers (running statistics, ``num_batches_tracked``): a training forward writes them
    and does not read them, so a recompute that starts from what the forward wrote computes the same output."""
    return [b for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
            for b in m.buffers(recurse=False)]


def _running_statistics(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics a training forward of ``module`` updates: BatchNorm's and InstanceNorm's kernels write
    them without bumping their version counters (``num_batches_tracked`` they do bump)."""
    return [b for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
            for b in (m.running_mean, m.running_var) if b is not None]


def _recompute(written: list[torch.Tensor], forward):
    """The forward again, leaving the buffers the first one wrote as it left them: BatchNorm's running statistics
    (in training, outputs come from the batch's own statistics) are updated once per step, as without
    checkpointing."""
    if not written:
        return forward()
    with outside_dispatch_modes():  # not ops of the checkpointed region (selective checkpointing matches them)
        kept = [b.detach().clone() for b in written]
    try:
        return forward()
    finally:  # also when the recompute stops early, having what backward needs
        with outside_dispatch_modes(), torch.no_grad():
            for buffer, value in zip(written, kept):
                buffer.copy_(value)


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
