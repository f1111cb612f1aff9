"""``torch.compile`` for a wrapped model: each unit compiled on its own, as torchtitan compiles each block.

``osdp.compile_units(model)`` calls ``module.compile(**kwargs)`` on every unit of
the plan that encloses no other unit (the root and enclosing units stay eager:
compiling them would compile their children again, inside FSDP2's hooks of
the parent). FSDP2's hooks are not traced (they are ``torch._dynamo``-disabled),
so its gathers, reshards and reductions run as in eager, around the unit's
compiled forward; a checkpointed unit recomputes its compiled forward.
Compiling the whole model (``model.compile()``) works too, with graph breaks
at FSDP2's hooks and DDP's reducer; a checkpointed unit that encloses other
units (a plan may checkpoint the root; the search never does) then runs
eagerly inside: Dynamo cannot break a checkpointed region's graph around the
FSDP2 hooks within it.

``SplitLinear`` is not traced: its slice loop issues collectives on a process
group from C++ (or from Python with asynchronous work handles), so it runs
eagerly between compiled regions, one graph break per split Linear
(``torch.compiler.disable``).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from osdp.fsdp_ext.apply import plan_of
from osdp.schema.plan import ROOT


def compile_units(model: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile every innermost unit of a model wrapped by ``osdp.wrap`` in place (``nn.Module.compile``
    with ``compile_kwargs``, e.g. ``backend=``, ``mode=``); returns their paths. Call it after ``wrap``,
    before the first step."""
    plan = plan_of(model)  # raises unless wrapped
    paths = [p for p in plan.paths if p != ROOT and not any(q.startswith(p + ".") for q in plan.paths)]
    for path in paths:
        model.get_submodule(path).compile(**compile_kwargs)
    return paths
