"""``model.load_state_dict`` of a state dict saved under any plan, or by the unwrapped model: every module
owning parameters brings each value to its parameter's layout before it loads
(``osdp.distributed.layouts.to_parameter_layout``).

Optimizer state follows its plan too: ``osdp.runtime.dcp`` saves and loads both
under any plan and on any number of ranks.
"""

from __future__ import annotations

import torch.nn as nn

from osdp.distributed.layouts import to_parameter_layout
from osdp.split import SplitLinear


def load_under_any_plan(model: nn.Module) -> None:
    """Let every module of ``model`` owning parameters load them from any plan's layout."""
    for module in model.modules():
        # a SplitLinear registers the hook itself: it loads so without a plan too
        if next(module.parameters(recurse=False), None) is not None and not isinstance(module, SplitLinear):
            module.register_load_state_dict_pre_hook(to_parameter_layout)
