"""A model built on the meta device (``torch.device("meta")``, as torchtitan builds large ones): alike on every
rank, and given memory by the user after wrapping, before its first forward."""

from __future__ import annotations

import torch.nn as nn

from osdp.distributed import all_gather_objects
from osdp.report import first_few
from osdp.schema.plan import PlanError


def built_on_meta(model: nn.Module) -> bool:
    """Whether ``model`` (which ``check_model`` took) lies on the meta device, to be given memory after wrapping."""
    return next(model.parameters()).is_meta


def check_built_alike(on_meta: bool) -> None:
    """Collective: raise on every rank unless every rank's model lies on the meta device or none does."""
    check_alike(all_gather_objects(on_meta))


def check_alike(everyone: list[bool]) -> None:
    if len(set(everyone)) > 1:
        meta = [r for r, m in enumerate(everyone) if m]
        raise PlanError(
            f"rank(s) {meta} built the model on the meta device and rank(s) "
            f"{[r for r in range(len(everyone)) if r not in meta]} on a real one: build it alike on every rank"
        )


def check_materialized_at_first_forward(model: nn.Module) -> None:
    # FSDP2 would fail deep in its first forward on parameters still without memory; say what to do instead
    def check(module: nn.Module, args) -> None:
        tensors = [*module.named_parameters(), *module.named_buffers()]
        still = [name for name, t in tensors if t.is_meta]
        if still:
            raise RuntimeError(
                f"the model is still on the meta device ({len(still)} of its {len(tensors)} parameters and buffers: "
                f"{first_few(still)}): after osdp.wrap, call model.to_empty(device=...) and initialise its "
                "parameters (or load them) before the first forward"
            )
        handle.remove()

    handle = model.register_forward_pre_hook(check, prepend=True)
