"""Every private PyTorch API OSDP uses, in one module, so a torch upgrade breaks one place.

Checked against torch 2.13. Heavy imports (FSDPMemTracker pulls in the whole
FSDP and DTensor stack, about a second) load on first use.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# TorchDispatchMode is documented, but lives in a private module.
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

__all__ = [
    "FSDPAllGatherBase",
    "FSDPGradient",
    "FSDPMemTracker",
    "module_tracker",
    "FSDPReduceScatterBase",
    "checkpoint_wrapper",
    "fsdp_device",
    "fsdp_pre_backward",
    "fsdp_refresh_reduce_dtype",
    "fsdp_skip_post_backward_if_never_gathered",
    "fsdp_replicate",
    "has_fsdp_replicate",
    "fsdp_before_reduce",
    "fsdp_collective_comm",
    "fsdp_refuse_graph_building_backward",
    "fsdp_hook_gathered_gradients",
    "fsdp_backward_cut_short",
    "fsdp_drop_gathered_gradients",
    "fsdp_register_gathered_again",
    "fsdp_modules",
    "fsdp_keep_forward_writes",
    "gradient_returned_not_accumulated",
    "output_tensors",
    "outside_dispatch_modes",
    "queue_at_backward_end",
    "selective_contexts_read_again",
    "set_implicit_replication",
    "ddp_bucket_bytes",
    "ddp_check_reducer_finalized",
    "ddp_post_forward",
    "ddp_pre_forward",
    "TorchDispatchMode",
    "init_fake_process_group",
    "is_traceable_wrapper_subclass",
    "is_traceable_wrapper_subclass_type",
    "storage_holders",
    "tensor_holders",
]


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Pose as ``rank`` of ``world_size`` in this one process: collectives do nothing.

    FSDP2 then shards, gathers and reduces exactly as it would on that rank
    (tensor shapes, memory), which is what planning and memory checks need;
    the values are garbage (all-gather outputs are never filled).
    """
    # Importing fake_pg registers the "fake" backend with c10d.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def ddp_bucket_bytes(ddp) -> int:
    """Bytes of a DistributedDataParallel's gradient buckets, from its logging record."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(b) for b in str(sizes).split(",") if b.strip())


def ddp_pre_forward(ddp, args, kwargs):
    """What ``DistributedDataParallel.forward`` does before the module runs (as composable ``replicate``)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._active_ddp_module = ddp
    return ddp._pre_forward(*args, **kwargs)


def ddp_post_forward(ddp, output):
    """What ``DistributedDataParallel.forward`` does after the module ran: arm the reducer for backward."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._active_ddp_module = None
    return ddp._post_forward(output)


def ddp_check_reducer_finalized(ddp) -> None:
    """Raise DDP's RuntimeError (listing the parameter indices) if a backward left buckets unreduced."""
    ddp._check_reducer_finalized()


def queue_at_backward_end(callback) -> None:
    """Run ``callback`` when the running backward ends (after the callbacks queued before it)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


def set_implicit_replication(allowed: bool) -> None:
    """What ``torch.distributed.tensor.experimental.implicit_replication`` sets on entry (True) and exit (False),
    for a window that is not a ``with`` block: DTensor ops take plain tensors as replicated DTensors."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = allowed


def outside_dispatch_modes() -> Any:
    """A context in which no TorchDispatchMode in effect sees the ops run (selective checkpointing's, a memory
    tracker's)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def selective_contexts_read_again(contexts: tuple) -> tuple:
    """Selective checkpointing's pair of contexts (``create_selective_checkpoint_contexts``), their storage of
    kept outputs made one a recompute reads without using it up: a second backward through a graph kept with
    ``retain_graph=True`` recomputes as the first did, as under full checkpointing (torch's own storage raises
    "Trying to backward an extra time"). A backward keeping the graph (``retain_graph=True``) leaves them for the
    next; any other frees each as its recompute reads it, as torch does (kept to the end of the region's
    backward, they would raise its peak past what the plan priced). Where torch stores them another way (an
    older torch), the pair as it was."""
    from collections import defaultdict

    import torch.utils.checkpoint as checkpoint

    used_up = getattr(checkpoint, "_CONSUMED", None)
    caching, cached = contexts
    if used_up is None or not isinstance(getattr(caching, "storage", None), dict) \
            or getattr(cached, "storage", None) is not caching.storage:
        return contexts

    keeps_graph = torch._C._autograd._get_current_graph_task_keep_graph

    class _ReadAgain(dict):
        def __setitem__(self, index, entry):
            if entry is not used_up or not keeps_graph():
                super().__setitem__(index, entry)

    caching.storage = cached.storage = defaultdict(_ReadAgain)
    return contexts


@contextlib.contextmanager
def outside_selective_checkpointing() -> Iterator[None]:
    """A context in which the selective checkpointing modes on top of the dispatch mode stack do not see the ops
    run; every mode below them (a memory tracker's) still does."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    popped = []
    while (stack := _get_current_dispatch_mode_stack()) and isinstance(
            stack[-1], (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def output_tensors(output: Any) -> list:
    """The tensors in a forward's output, found as ``DistributedDataParallel`` finds them."""
    from torch.nn.parallel.distributed import _find_tensors

    return list(_find_tensors(output))


def tensor_holders(t: Any) -> int:
    """How many references hold ``t``'s TensorImpl: Python's, views' (each keeps its base), C++ code's."""
    return t._use_count()


def storage_holders(t: Any) -> int:
    """How many references hold the memory under ``t``: its TensorImpl and every other alias's."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # less the Python storage object made here


def fsdp_device(module: Any) -> Any:
    """The device a ``fully_shard``-ed module computes and communicates on."""
    return module._get_fsdp_state()._device


def fsdp_pre_backward(module: Any) -> Any:
    """A tensor hook running a ``fully_shard``-ed module's pre-backward (gather its parameters, prefetch) unless
    it has run in this backward: what FSDP2 hooks on each output tensor."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = module._get_fsdp_state()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if state._training_state != TrainingState.PRE_BACKWARD:
            return state._pre_backward(grad)
        return grad

    return hook


class FSDPGradient:
    """One parameter's unsharded gradient slot in a ``fully_shard``-ed module, as FSDP2's post-backward reads it."""

    def __init__(self, fsdp_param: Any):
        self._param = fsdp_param

    @property
    def present(self) -> bool:
        """Whether this rank has a gradient to reduce (accumulated or from this backward)."""
        p = self._param
        return hasattr(p, "_unsharded_param") and (
            p.unsharded_accumulated_grad is not None or p.unsharded_param.grad is not None)

    def fill_zeros(self) -> None:
        self._param.unsharded_param.grad = torch.zeros_like(self._param.unsharded_param)


def _around_post_backward(module: Any, flag: str, around: Any) -> None:
    """Make each parameter group of a ``fully_shard``-ed module run ``around(group, post_backward, *args)`` in place
    of its post-backward, once per group (``flag`` marks it), however many modules share it."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if getattr(group, flag, False):
            continue
        setattr(group, flag, True)
        original = group.post_backward

        def post_backward(*args: Any, group: Any = group, original: Any = original) -> Any:
            return around(group, original, *args)

        group.post_backward = post_backward


def fsdp_before_reduce(module: Any, hook: Any) -> None:
    """Call ``hook(gradients)`` wherever FSDP2 is about to reduce a ``fully_shard``-ed module's gradients (its
    post-backward with gradient sync on); ``gradients``: an ``FSDPGradient`` per parameter that requires one.
    Once per parameter group, however many modules share it."""

    def around(group: Any, post_backward: Any, *args: Any) -> Any:
        if group.reduce_grads:
            hook([FSDPGradient(p) for p in group.fsdp_params if p.sharded_param.requires_grad])
        return post_backward(*args)

    _around_post_backward(module, "_osdp_before_reduce", around)


def fsdp_refuse_graph_building_backward(module: Any, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` where a backward building a graph (``create_graph=True``: a gradient penalty, MAML's
    inner step) reaches a ``fully_shard``-ed module's post-backward: FSDP2 frees the gathered parameters there
    (or, told to keep them, reduces the gradients before the created graph's own backward has given them), so the
    later backward fails on freed memory or leaves gradients out. Such a backward runs with grad mode on; an
    ordinary one with it off."""

    def around(group: Any, post_backward: Any, *args: Any) -> Any:
        if torch.is_grad_enabled() and any(hasattr(p, "_unsharded_param") for p in group.fsdp_params):
            raise error()
        return post_backward(*args)

    _around_post_backward(module, "_osdp_refuses_graph_building", around)


def fsdp_refresh_reduce_dtype(module: Any) -> None:
    """Set again the dtypes of a ``fully_shard``-ed module's parameter groups none of whose parameters required a
    gradient when FSDP2 set them (its first forward) and one does now: FSDP2 keeps no reduce dtype for such a
    group, so under a ``MixedPrecisionPolicy`` it reduced the unfrozen parameters' bf16 gradients in bf16 and
    failed to assign them to the fp32 parameters."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if getattr(group, "_orig_dtype", False) is None and any(p.sharded_param.requires_grad for p in group.fsdp_params):
            group._init_mp_dtypes()


def fsdp_skip_post_backward_if_never_gathered(module: Any) -> None:
    """Make a ``fully_shard``-ed module's parameter groups skip the post-backward FSDP2's final callback runs on
    a group whose parameters were never gathered (a module no forward has called yet): there is no gradient to
    reduce or accumulate, and under a ``MixedPrecisionPolicy`` with gradient sync off FSDP2 reads the unsharded
    parameters it never made, and fails."""

    def around(group: Any, post_backward: Any, *args: Any) -> Any:
        if not any(hasattr(p, "_unsharded_param") for p in group.fsdp_params):
            return None
        return post_backward(*args)

    _around_post_backward(module, "_osdp_skips_ungathered", around)


def fsdp_gather_outside_inference_mode(module: Any) -> None:
    """Make a ``fully_shard``-ed module gather (and make its gathered parameters) as outside ``torch.inference_mode``.

    FSDP2 makes a unit's gathered parameters and all-gather outputs at its first gather and copies into them at
    every gather after; made under inference mode (an evaluation before any training: Lightning's sanity check,
    a zero-shot score) they are inference tensors, which no later gather outside it may write to, so training
    fails. Made as normal tensors they serve both (a forward in inference mode reads them as any tensor)."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for name in ("unshard", "wait_for_unshard"):
            if not hasattr(group, f"_osdp_{name}"):
                setattr(group, f"_osdp_{name}", True)
                setattr(group, name, _outside_inference_mode(getattr(group, name)))


def _outside_inference_mode(method: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)

    return run


def fsdp_backward_cut_short(root: Any) -> bool:
    """Whether the last backward through the ``fully_shard``-ed ``root`` raised before its end (FSDP2's callback
    for the end, queued as it began, never ran) and no backward runs now."""
    state = root._get_fsdp_state()
    return state._state_ctx.post_backward_final_callback_queued and torch._C._current_graph_task_id() == -1


def fsdp_drop_gathered_gradients(module: Any) -> None:
    """Let go of the gradients on a ``fully_shard``-ed module's gathered parameters (and those accumulated
    unsharded without gradient sync): a backward that raised left them there, and FSDP2's ``reset_iter_state``
    keeps them, so the next backward would add to them."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None
            fsdp_param.unsharded_accumulated_grad = None


def fsdp_modules(model: Any) -> list:
    """The modules of ``model`` that FSDP2 holds a state for (``fully_shard``-ed or ``replicate``-d)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule) and hasattr(m, "_get_fsdp_state")]


def fsdp_register_gathered_again(module: Any) -> None:
    """Register again on their modules the gathered parameters of a ``fully_shard``-ed module's groups that are
    gathered now (where something else was put in their place since FSDP2 registered them)."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if group.is_unsharded:
            for fsdp_param in group.fsdp_params:
                info, gathered = fsdp_param._module_info, fsdp_param._unsharded_param
                if info.module._parameters.get(info.param_name) is not gathered:  # a dict read per backward
                    fsdp_param._setattr_on_modules(gathered)


def fsdp_hook_gathered_gradients(module: Any, hooks_of: Callable[[Any, str, torch.Tensor], list]) -> None:
    """Register on each gathered parameter of a ``fully_shard``-ed module the gradient hooks
    ``hooks_of(owner module, attribute, gathered parameter)``: the hooks its parameter had before wrapping
    (``p.register_hook(fn)`` in a model's ``__init__``, masking rows of an embedding), which DDP runs on each
    rank's gradient before its reduction, and osdp's own. FSDP2 computes with new gathered parameters, so hooks
    on the old ones would never run."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if not getattr(fsdp_param, "_osdp_hooks_gathered", False):
                fsdp_param._osdp_hooks_gathered = True
                info = fsdp_param._module_info
                _hook_when_gathered(fsdp_param, lambda gathered, info=info: hooks_of(info.module, info.param_name,
                                                                                    gathered))


def _hook_when_gathered(fsdp_param: Any, hooks_of: Callable[[torch.Tensor], list]) -> None:
    to_unsharded = fsdp_param.to_unsharded

    def unsharded() -> None:
        to_unsharded()
        gathered = fsdp_param._unsharded_param  # made at the first gather, the same object after
        # (frozen, it takes no hook: at the first gather after it is unfrozen)
        if gathered.requires_grad and not getattr(gathered, "_osdp_hooks_carried", False):
            gathered._osdp_hooks_carried = True
            for hook in hooks_of(gathered):
                gathered.register_hook(hook)

    fsdp_param.to_unsharded = unsharded


def gradient_returned_not_accumulated(param: torch.Tensor) -> bool:
    """Whether the backward running now computes ``param``'s gradient for ``torch.autograd.grad`` to return (the
    engine captures it) instead of accumulating it into ``param.grad``. Torch says so only by refusing to answer
    ``_will_engine_execute_node`` for that leaf's node, with this message."""
    from torch.autograd.graph import get_gradient_edge

    if not param.requires_grad:  # frozen during this backward: it accumulates nothing either way
        return False
    try:
        torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError as e:
        if "running autograd.grad()" in str(e):
            return True
        raise
    return False


def fsdp_keep_forward_writes(module: Any, fingerprint: Callable[[torch.Tensor], Any],
                             written: Callable[[str, torch.Tensor], None]) -> None:
    """Make a ``fully_shard``-ed module's parameters keep what a forward wrote to them in place while gathered (a
    momentum encoder's update under ``no_grad``, a weight decayed in its own forward): FSDP2 frees the gathered
    copy when it reshards, and the write would be lost. Each rank copies its shard of the written parameter back
    first, which is right where every rank wrote the same values (``fsdp_ext.forward_writes`` checks that they
    did). Once per parameter, however many modules share it.

    A write bumps the parameter's version, or replaces its memory (``p.data = ...``); one through ``p.data``
    (``p.data.mul_(m)``) does neither, so the first ``_CHECKED_GATHERS`` times a parameter is gathered its sum
    and norm (``fingerprint``) are compared too, and a parameter found written that way is copied back at every
    reshard after. ``written(name, gathered)`` is told of each write before it is copied back."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if not getattr(fsdp_param, "_osdp_keeps_writes", False):
                fsdp_param._osdp_keeps_writes = True
                _keep_writes(fsdp_param, fingerprint, written)


_CHECKED_GATHERS = 3  # the first training step's forward and backward, and one more


def _keep_writes(fsdp_param: Any, fingerprint: Callable[[torch.Tensor], Any],
                 written: Callable[[str, torch.Tensor], None]) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    to_unsharded, to_sharded = fsdp_param.to_unsharded, fsdp_param.to_sharded
    gathered: dict[str, Any] = {}  # the gathered parameter's version, memory and values as FSDP2 made it
    seen = {"checks_left": _CHECKED_GATHERS, "written_through_data": False}

    def unsharded() -> None:
        to_unsharded()
        p = fsdp_param._unsharded_param
        gathered["as_made"] = (p._version, p.data_ptr())
        if seen["checks_left"] > 0 and not seen["written_through_data"] and p.numel() > 0:
            seen["checks_left"] -= 1
            gathered["values"] = fingerprint(p)

    def sharded() -> None:
        as_made, values = gathered.pop("as_made", None), gathered.pop("values", None)
        if fsdp_param.sharded_state == ShardedState.UNSHARDED and as_made is not None:
            p = fsdp_param._unsharded_param
            if values is not None and fingerprint(p) != values:
                seen["written_through_data"] = True
            if seen["written_through_data"] or (p._version, p.data_ptr()) != as_made:
                written(fsdp_param._param_fqn or fsdp_param._module_info.param_name, p)
                _write_back_shard(fsdp_param, p)
        to_sharded()

    fsdp_param.to_unsharded, fsdp_param.to_sharded = unsharded, sharded


def _write_back_shard(fsdp_param: Any, gathered: torch.Tensor) -> None:
    mesh_info = fsdp_param.mesh_info
    rank, size = getattr(mesh_info, "shard_mesh_rank", 0), getattr(mesh_info, "shard_mesh_size", 1)
    chunks = torch.chunk(gathered.detach(), size, dim=fsdp_param.fsdp_placement.dim)
    if rank < len(chunks):
        with torch.no_grad():
            fsdp_param.sharded_param._local_tensor.copy_(chunks[rank])


def dtensor_local_part(dtensor: Any, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (a plain tensor of ``dtensor``'s global shape) as ``dtensor`` lays it out."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, dtensor.device_mesh, dtensor.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def register_foreach_type(cls: type) -> None:
    """Let optimizers and ``torch.nn.utils`` run their foreach kernels on tensors of class ``cls`` (a DTensor
    subclass), as ``torch.distributed.tensor`` lets them on DTensors."""
    from torch.optim.optimizer import _foreach_supported_types as optimizer_types
    from torch.utils._foreach_utils import _foreach_supported_types as util_types

    for types in (optimizer_types, util_types):
        if cls not in types:
            types.append(cls)


def fsdp_collective_comm(module: Any, collective: str) -> Any:
    """The ``all_gather`` or ``reduce_scatter`` object of a ``fully_shard``-ed module's parameter group (None
    if it has none)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    groups = module._get_fsdp_state()._fsdp_param_groups
    return getattr(groups[0], f"_{collective}_comm") if groups else None


def replicated_by_fsdp2(module: Any) -> bool:
    """Whether a ``fully_shard``-ed module is FSDP2's ``replicate``: parameter groups that hold their parameters
    whole (``set_reshard_after_forward`` asserts on them; there is nothing to reshard)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    return any(not isinstance(g.mesh_info, FSDPMeshInfo) for g in module._get_fsdp_state()._fsdp_param_groups)


def has_fsdp_replicate() -> bool:
    """Whether this torch has FSDP2's ``replicate`` on a 1-D mesh (2.10 on; 2.9's takes an (N, 1) one)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "DDPMeshInfo")


def fsdp_replicate(module: Any, **kwargs: Any) -> Any:
    """FSDP2's ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``): FSDP2's machinery with the
    parameters replicated on a 1-D mesh (DTensors, ``Replicate()``), an ``FSDPModule``; ``kwargs`` as
    ``fully_shard``'s but ``reshard_after_forward`` (``has_fsdp_replicate``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(module, **kwargs)


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> Any:
    """Activation checkpointing of ``module``, non-reentrant, as torchtitan applies it per block (state-dict
    keys are unchanged: the wrapper strips its own prefix); ``checkpoint_kwargs`` go to
    ``torch.utils.checkpoint.checkpoint`` (``context_fn``: a selective policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrapper

    return wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **checkpoint_kwargs)


@contextlib.contextmanager
def module_tracker() -> Iterator[None]:
    """PyTorch's module tracker, as ``FSDPMemTracker`` and ``MemTracker`` run it: hooks on every module's inputs and
    outputs. Its gradient hooks are removed on exit: it leaves them on tensors whose gradients were not all computed,
    where they hold the autograd graph, and through it the model, in a cycle gc cannot break."""
    from torch.distributed._tools import mod_tracker

    register, handles = mod_tracker.register_multi_grad_hook, []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        handles.append(register(*args, **kwargs))
        return handles[-1]

    mod_tracker.register_multi_grad_hook = recorded
    try:
        with mod_tracker.ModTracker():
            yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


def __getattr__(name: str) -> Any:
    if name == "FSDPMemTracker":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker
    if name == "FSDPAllGatherBase":
        # The interface FSDPModule.set_custom_all_gather takes (public method, private base class).
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        return AllGather
    if name == "FSDPReduceScatterBase":
        # The interface FSDPModule.set_custom_reduce_scatter takes (public method, private base class).
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        return ReduceScatter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
