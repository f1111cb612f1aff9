"""Replicated units, reduced the way ``DistributedDataParallel`` reduces them.

Every replicated unit's parameters go to one DDP reducer: gradients are
copied into buckets (25 MiB, the first 1 MiB, rebuilt after the first step in
the order backward produces them) and each bucket is all-reduced
asynchronously as soon as it is full, while backward goes on. Parameters stay
plain tensors, used in place: no second copy during forward and backward, as
with DDP itself. Sharded units around and inside them are FSDP2's, which
leaves these parameters alone (``ignored_params``).

This is what ``torch.distributed._composable.replicate`` does for a whole
module; OSDP needs it for a set of units that may sit under a sharded root,
which ``replicate`` refuses, so the reducer is driven from the model's own
forward hooks here.

Plans in bf16 replicate with FSDP2 instead (``fsdp_ext.apply``): compute in
bf16 needs a bf16 copy of the parameters either way, which FSDP2's
``MixedPrecisionPolicy`` makes and DDP's experimental mixed precision only
makes for a module it runs itself.
"""

from __future__ import annotations

import re
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from osdp._torch_private import (
    ddp_check_reducer_finalized, ddp_post_forward, ddp_pre_forward, output_tensors, queue_at_backward_end,
)


def replicates_with_ddp(mixed_precision: str) -> bool:
    """Whether a plan's replicated units run on the DDP reducer (fp32) or on FSDP2 (bf16)."""
    return mixed_precision == "fp32"


class UnusedParametersError(RuntimeError):
    """Replicated parameters got no gradient in a backward while unused parameters were not looked for."""


class ReplicatedParameters:
    """One DDP reducer over ``params`` (name -> parameter), run by forward hooks on ``model`` (the root).

    ``find_unused_parameters`` is DDP's: False (DDP's default, and faster: no walk of the autograd graph
    after each forward) expects every parameter to get a gradient in every backward; a backward where one
    does not raises ``UnusedParametersError`` from ``backward()``, before any optimizer step, naming them.
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], device: torch.device,
                 find_unused_parameters: bool = False):
        self.names = list(params)
        self.params = nn.ParameterList(params.values())
        self.ddp = DistributedDataParallel(
            self.params,
            device_ids=[device] if device.type == "cuda" else None,
            # gradients are views into the buckets: one copy of them, not two
            gradient_as_bucket_view=True,
            find_unused_parameters=find_unused_parameters,
        )
        if dist.get_backend(self.ddp.process_group) == "fake":
            # the fake process group (one process posing as a rank, for memory) completes an all-reduce
            # with no value, which DDP's built-in hook refuses: the bucket stays as it is, as the fake
            # group leaves every other collective's output
            self.ddp.register_comm_hook(None, _unreduced)
        # The reducer allocates its buckets where no Python code sees them, and the CPU memory tracker
        # must count them. The gradients are views into them after a backward, so each optimizer step
        # notes their storages. (A Python comm hook sees the buckets too, but cost ~5% of a gpt2-mini
        # step on gloo here against DDP's built-in all-reduce.)
        self._buckets: dict[int, weakref.ref] = {}  # storage address -> a bucket's storage
        self._step_hook = register_optimizer_step_pre_hook(_weak(self._note_buckets))
        _step_mixed_optimizers_with_implicit_replication()
        self._hooks = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post_forward),
        ]

    def __del__(self) -> None:
        self._step_hook.remove()

    def bucket_storages(self) -> list[torch.UntypedStorage]:
        """The reducer's gradient buckets (known from the first optimizer step on): memory to count."""
        alive = (ref() for ref in self._buckets.values())
        return [s for s in alive if s is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: gradients accumulate locally (as under ``DistributedDataParallel.no_sync``)."""
        self.ddp.require_backward_grad_sync = requires_gradient_sync

    def _note_buckets(self, *_) -> None:
        # DDP rebuilds its buckets after the first step, and a new bucket can take a freed one's address:
        # the entry of a bucket that is gone is replaced, not kept (its storage was then never counted)
        self._buckets = {key: ref for key, ref in self._buckets.items() if ref() is not None}
        for p in self.params:
            if p.grad is not None:
                storage = p.grad.untyped_storage()
                ref = self._buckets.get(storage._cdata)
                if ref is None or ref() is not storage:
                    self._buckets[storage._cdata] = weakref.ref(storage)

    def _pre_forward(self, module, args, kwargs):
        return ddp_pre_forward(self.ddp, args, kwargs)

    def _post_forward(self, module, args, output):
        output = ddp_post_forward(self.ddp, output)
        if torch.is_grad_enabled() and self.ddp.require_backward_grad_sync and not self.ddp.find_unused_parameters:
            grads_from = [t for t in output_tensors(output) if t.requires_grad]
            if grads_from:
                register_multi_grad_hook(grads_from, self._check_after_backward, mode="any")
        return output

    def _check_after_backward(self, _grad) -> None:
        # Runs as backward starts; the check must follow the reducer's own end-of-backward callback, which
        # it queues once its last bucket is ready, so it queues itself again from the first callback.
        queue_at_backward_end(lambda: queue_at_backward_end(self._check_reducer_finalized))

    def _check_reducer_finalized(self) -> None:
        try:
            ddp_check_reducer_finalized(self.ddp)
        except RuntimeError as e:
            listed = _UNUSED_INDICES.search(str(e))
            unused = [self.names[int(i)] for i in listed.group(1).split()] if listed else []
            which = f" ({', '.join(unused)})" if unused else ""
            raise UnusedParametersError(
                f"replicated parameters got no gradient in this backward{which}: a module the forward did not "
                "call, or a branch it did not take. Nothing was reduced or stepped with them; wrap the model with "
                "osdp.wrap(..., find_unused_parameters=True), which looks for them after every forward, as "
                "DistributedDataParallel does with that setting"
            ) from None


# DDP's message lists the parameters (indices into the reducer's list) that got no gradient on this rank
_UNUSED_INDICES = re.compile(r"did not receive grad for rank \d+: ([\d ]+)")


def _weak(method):
    """A hook calling ``method`` while its object lives: a global hook must not keep a model alive."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


def _unreduced(_state, bucket):  # unannotated: DDP checks a hook's annotations by identity
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# Optimizers over a model with replicated and sharded units hold plain tensors (DDP's) beside DTensors
# (FSDP2's and split weights). torch's foreach and fused kernels, the default on CUDA, refuse such a mix
# in one list, so the step of such an optimizer runs under DTensor's implicit replication, which takes
# the plain tensors as replicated: they are, DDP has made them equal on every rank.
_implicit: dict[int, object] = {}  # id(optimizer) -> its implicit_replication context, during its step
_hooks_installed = False


def _mixes_plain_and_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    kinds = {isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]}
    return len(kinds) == 2


def _enter_implicit_replication(optimizer: torch.optim.Optimizer, *_) -> None:
    if _mixes_plain_and_dtensors(optimizer):
        context = implicit_replication()
        context.__enter__()
        _implicit[id(optimizer)] = context


def _exit_implicit_replication(optimizer: torch.optim.Optimizer, *_) -> None:
    context = _implicit.pop(id(optimizer), None)
    if context is not None:
        context.__exit__(None, None, None)


def _step_mixed_optimizers_with_implicit_replication() -> None:
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_enter_implicit_replication)
        register_optimizer_step_post_hook(_exit_implicit_replication)
        _hooks_installed = True
