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

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from osdp._torch_private import ddp_post_forward, ddp_pre_forward


def replicates_with_ddp(mixed_precision: str) -> bool:
    """Whether a plan's replicated units run on the DDP reducer (fp32) or on FSDP2 (bf16)."""
    return mixed_precision == "fp32"


class ReplicatedParameters:
    """One DDP reducer over ``params``, run by forward hooks on ``model`` (the root)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], device: torch.device):
        self.params = nn.ParameterList(params)
        self.ddp = DistributedDataParallel(
            self.params,
            device_ids=[device] if device.type == "cuda" else None,
            # gradients are views into the buckets: one copy of them, not two
            gradient_as_bucket_view=True,
            # a unit may sit out a step (a branch, a frozen part): without this DDP would wait for its
            # gradients and fail the next step; measured within 1-3% of the default on gpt2-tiny here
            find_unused_parameters=True,
        )
        self._buckets: dict[int, weakref.ref] = {}  # bucket index -> its flat gradient storage
        self.ddp.register_comm_hook(None, self._all_reduce)
        self._hooks = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post_forward),
        ]

    def bucket_storages(self) -> list[torch.UntypedStorage]:
        """The reducer's gradient buckets (known after the first backward): memory a tracker must count."""
        alive = (ref() for ref in self._buckets.values())
        return [s for s in alive if s is not None]

    def _all_reduce(self, _state, bucket):  # unannotated: DDP checks a hook's annotations by identity
        # DDP's own all-reduce (the average of the flat bucket), noting the bucket on the way: the
        # reducer allocates buckets where no Python code sees them, and the CPU memory tracker must.
        buffer = bucket.buffer()
        self._buckets[bucket.index()] = weakref.ref(buffer.untyped_storage())
        group = self.ddp.process_group
        work = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True)
        return work.get_future().then(lambda _: buffer)  # reduced in place

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: gradients accumulate locally (as under ``DistributedDataParallel.no_sync``)."""
        self.ddp.require_backward_grad_sync = requires_gradient_sync

    def _pre_forward(self, module, args, kwargs):
        return ddp_pre_forward(self.ddp, args, kwargs)

    def _post_forward(self, module, args, output):
        return ddp_post_forward(self.ddp, output)
