"""What measuring a model leaves as it was: its state, torch's random numbers, and the user's hooks unaware.

Planning runs the user's model: every rank traces one forward of its own example
(``osdp.planner.calls_on_every_rank``) and rank 0 describes it (``osdp.describe``),
forward and backward many times. None of it may show in what the user's code sees
afterwards, or a searched wrap would differ from a wrap with a given plan, and rank 0
from the others:

* ``state_kept``: parameters, buffers and modules' plain attributes, written by a
  training forward (BatchNorm's statistics, a step counter, a momentum encoder);
* ``rng_kept``: the random numbers the next forward draws (dropout, LayerDrop);
* ``users_hooks_held``: the hooks the user registered on modules and parameters
  (counting calls, collecting activations, stepping an optimizer from a gradient
  hook) do not fire for the measuring passes. Torch's own hooks (weight norm,
  pruning masks) and osdp's stay: they compute what the module runs.

``quietly(model, run)`` runs a measurement with all three; a model that only runs
with its user's hooks (one making its embeddings' output require gradients) is
measured with them, as a fallback.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.nn as nn

T = TypeVar("T")

_PLAIN = (int, float, bool, str, type(None))

# the hook tables of nn.Module that fire while a module runs forward or backward
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# and of a tensor (a parameter): Tensor.register_hook, Tensor.register_post_accumulate_grad_hook
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


@contextlib.contextmanager
def rng_kept(devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Torch's random number generators (the CPU's, and those of the CUDA ``devices``) as they were after the
    block."""
    with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices if d.type == "cuda"})):
        yield


@contextlib.contextmanager
def state_kept(model: nn.Module) -> Iterator[None]:
    """Parameters, buffers and the modules' plain attributes as they were after the block: a training forward
    updates some (BatchNorm's running statistics, a step counter in a buffer or in ``self.step``, which a model
    may read to choose its branch, a momentum encoder's weights), and a describe on rank 0 alone must leave them
    as the other ranks' and an unwrapped run's, or the ranks would run different forwards."""
    saved = {b: b.detach().clone() for b in model.buffers()}
    # and the parameters a forward writes in place (a MoCo key encoder's momentum update), kept in host memory
    # so that a GPU's budget does not hold them twice
    weights = {p: p.detach().to("cpu", copy=True) for p in model.parameters() if not p.is_meta}
    attributes = [(m, k, v) for m in model.modules() for k, v in vars(m).items() if isinstance(v, _PLAIN)]
    try:
        # and the random numbers: every describe of the model (one per unit granularity) draws what the user's
        # next forward will (a dropped layer, LayerDrop's), so they see the same units run
        with rng_kept([p.device for p in model.parameters()]):
            yield
    finally:
        with torch.no_grad():
            for b, value in saved.items():
                b.copy_(value)
            for p, value in weights.items():
                p.copy_(value)
        for m, k, v in attributes:
            if m.__dict__.get(k, v) is not v:
                m.__dict__[k] = v


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """The sum and norm of ``t``'s values: whether a write through ``t.data`` (which bumps no version and keeps
    the memory) changed it, for one read of it."""
    with torch.no_grad():
        t = t.detach()
        flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).float()  # a complex one's both parts
        return float(flat.sum()), float(torch.linalg.vector_norm(flat))


def _defined_in(hook: Any) -> str:
    """The module a hook's code comes from (a function's, a partial's function's, a callable object's class's)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    owner = getattr(hook, "__self__", None)
    if owner is not None:  # a bound method: its object's class says whose it is
        return type(owner).__module__ or ""
    return getattr(hook, "__module__", None) or type(hook).__module__ or ""


def _users(hook: Any) -> bool:
    return _defined_in(hook).split(".")[0] not in ("torch", "osdp")


def defined_by_osdp(hook: Any) -> bool:
    return _defined_in(hook).split(".")[0] == "osdp"


def defined_by_torch(hook: Any) -> bool:
    return _defined_in(hook).split(".")[0] == "torch"


def defined_by_fsdp(hook: Any) -> bool:
    return _defined_in(hook).startswith("torch.distributed.fsdp")


def _held_tables(model: nn.Module) -> list[tuple[Any, str, dict]]:
    """(owner, table name, the table as it is) for every hook table with a user's hook in it."""
    tables = []
    for m in model.modules():
        for name in _MODULE_HOOKS:
            table = getattr(m, name, None)
            if table and any(_users(h) for h in table.values()):
                tables.append((m, name, table))
    for p in model.parameters():
        for name in _TENSOR_HOOKS:
            table = getattr(p, name, None)
            if table and any(_users(h) for h in table.values()):
                tables.append((p, name, table))
    return tables


@contextlib.contextmanager
def users_hooks_held(model: nn.Module) -> Iterator[None]:
    """The user's hooks on ``model``'s modules and parameters do not fire in the block; torch's and osdp's do.

    Each table is swapped for a copy without the user's hooks and put back after: the handles the user holds
    point at the original tables, so removing a hook later still works, and a hook osdp registers and removes
    in the block lands in the copy."""
    tables = _held_tables(model)
    try:
        for owner, name, table in tables:
            # assigning a tensor's table re-registers it with autograd; a module's is read at each call
            setattr(owner, name, type(table)((k, h) for k, h in table.items() if not _users(h)))
        yield
    finally:
        for owner, name, table in tables:
            setattr(owner, name, table)


def has_users_hooks(model: nn.Module) -> bool:
    return bool(_held_tables(model))


def quietly(model: nn.Module, run: Callable[[], T]) -> T:
    """``run()`` (a measurement of ``model``) with its state, random numbers and the user's hooks kept; again
    with the user's hooks firing if it fails without them (the model needs them to run), and then its error is
    the model's own."""
    if has_users_hooks(model):
        try:
            with state_kept(model), users_hooks_held(model):
                return run()
        except Exception:  # noqa: BLE001 - run again as the user's hooks make the model run; raises its own error
            pass
    with state_kept(model):
        return run()
