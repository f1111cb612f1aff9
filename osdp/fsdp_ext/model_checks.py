"""What a model must be for a plan to apply to it, checked on every rank before anything changes.

``osdp.wrap`` runs ``check_model`` before the search's collectives and any look at the units, and
``apply_plan`` again for a plan given as it is; each rank's error reaches every rank
(``distributed.group.raise_on_any_rank``, ``apply.check_same_plan_everywhere``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parameter import is_lazy

from osdp.describe.units import sparse_gradients_message
from osdp.distributed import world
from osdp.report import first_few
from osdp.schema.plan import ROOT, PlanError, display_path

PLAN_ATTR = "_osdp_plan"  # where a wrapped model keeps the plan applied to it (``apply.plan_of``)


def check_model(model: nn.Module, device: torch.device) -> None:
    """Raise PlanError unless the model is not yet distributed (by osdp, DistributedDataParallel or fully_shard),
    holds no TorchScript module, has parameters, all on one device that ``device`` can use or all on the meta
    device, none lazy (``nn.LazyLinear`` before its first forward), and no embedding that renormalizes its rows
    in its forward (``max_norm``) when the job has several ranks.

    A model wholly on the meta device is taken, as FSDP2 takes it: wrapped, then
    given memory (``model.to_empty(device=...)``) and initialised by the user before
    its first forward (``built_on_meta``). FSDP2 would accept a model partly on
    the meta device (or spread over devices) and fail only at the first forward,
    or worse; osdp says so before anything changes.
    """
    if getattr(model, PLAN_ATTR, None) is not None:
        raise PlanError("this model is already wrapped by osdp; wrap a fresh model (osdp.plan_of(model) shows its plan)")
    wrappers = [name for name, m in model.named_modules()
                if isinstance(m, (nn.parallel.DistributedDataParallel, FSDPModule))]
    if wrappers:
        what = "DistributedDataParallel" if isinstance(model.get_submodule(wrappers[0]),
                                                        nn.parallel.DistributedDataParallel) else "fully_shard"
        where = "the model" if wrappers[0] == ROOT else f"its module '{wrappers[0]}'"
        raise PlanError(
            f"{where} is already distributed by {what}: osdp replicates and shards the model itself, and two of "
            "them would reduce the same gradients; pass the model as built, before DistributedDataParallel or "
            "fully_shard (a DistributedDataParallel's model.module)"
        )
    scripted = [name for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    outermost = [n for n in scripted if not any(o != n and (o == ROOT or n.startswith(o + ".")) for o in scripted)]
    if outermost:
        raise PlanError(
            f"{first_few([display_path(n) for n in outermost])}: TorchScript modules (torch.jit.script or "
            "torch.jit.trace of a module), which FSDP2 can neither hook nor shard (PyTorch: "
            "register_forward_pre_hook is not supported on ScriptModules); keep them as Python modules (functions "
            "the forward calls may stay scripted), and compile with torch.compile instead"
        )
    if next(model.parameters(), None) is None:
        raise PlanError("the model has no parameters: there is nothing to shard or replicate")
    sparse = [f"{name}.weight" if name else "weight" for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise PlanError(sparse_gradients_message(first_few(sparse)))
    renormed = [name for name, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    if renormed and world()[1] > 1:
        raise PlanError(
            f"{first_few(renormed)}: an embedding with max_norm renormalizes in place, in its forward, the rows its "
            "batch looks up: each rank would renormalize the rows of its own batch and the ranks' tables would "
            "differ from one process's (which renormalizes those of the whole batch); build it with max_norm=None, "
            "and renormalize the table after each optimizer step if you need the bound (the same on every rank)"
        )
    _check_tensors(model, device)


def _check_tensors(model: nn.Module, device: torch.device) -> None:
    """None lazy; all on the meta device, or all on one device that ``device`` can use."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    lazy = [name for name, t in tensors if is_lazy(t)]
    if lazy:
        raise PlanError(
            f"the model has lazy modules not yet initialized ({first_few(lazy)}): their shapes are known only after "
            "a forward; call the model once on a batch (model(example)) before osdp.wrap"
        )
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if on_meta and len(on_meta) < len(tensors):
        raise PlanError(
            f"the model is partly materialized: {len(on_meta)} of its {len(tensors)} parameters and buffers are on "
            f"the meta device ({first_few(on_meta)}); build it all on the meta device (then osdp.wrap, "
            "model.to_empty(device=...) and your initialisation) or all on a real device"
        )
    if on_meta:
        return  # it gets its memory after wrapping, on the device it is then moved to
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors:
        by_device.setdefault(t.device, []).append(name)
    if len(by_device) > 1:
        where = "; ".join(f"{d}: {first_few(names, 2)}" for d, names in by_device.items())
        raise PlanError(
            f"the model's parameters and buffers are on several devices ({where}); move the whole model to one "
            "device (model.to(...)) before osdp.wrap"
        )
    (on,) = by_device
    if on.type != "cpu" and (on.type != device.type or (on.index is not None and device.index is not None
                                                         and on.index != device.index)):
        raise PlanError(
            f"the model is on {on} but osdp.wrap would run it on {device}; pass device='{on}' (with a process "
            "group for that device, nccl for cuda) or move the model"
        )
