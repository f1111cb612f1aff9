"""Operator splitting: gather a large Linear's sharded weight in k slices, one after another.

A plan's ``split: k`` for a zero3 unit turns the unit's ``splittable_linears``
into ``SplitLinear`` (``apply_split``); the unit is then ``fully_shard``-ed with
``ignored_params=split_parameters(unit)`` so that FSDP2 manages everything else
(biases included) and leaves the slices to SplitLinear.

Checkpoints. A SplitLinear's ``weight`` is the same Shard(0) DTensor, under
the same key, that FSDP2 makes of an ``nn.Linear`` weight, so:

- ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``
  gives the same keys and values as the unsplit model, and
  ``set_model_state_dict`` loads a full state dict (from either) back;
- ``model.load_state_dict`` accepts an unsplit model's plain full weight (each
  rank keeps its rows, no communication) and a weight of another layout
  (``osdp.distributed.layouts``); the other way, an unsplit model takes the full
  state dict above;
- sharded ``torch.distributed.checkpoint`` save/load works between a split
  model (any k) and an unsplit one, FSDP2-sharded or plain, and across world
  sizes (DCP reshards; tested: saved on 2 ranks, loaded on 2 and on 4).

Implementations: the C++ extension in ``csrc/`` (shipped in the package as
``osdp/_csrc/``), built on first use or by ``osdp build-ext`` into a cache that
ranks share (``backend()`` "cpp", or "cuda" where CUDA tensors take its stream
path), else the PyTorch loop ("python"), same semantics; ``OSDP_SPLIT_BACKEND``
or ``set_backend`` chooses.
"""

from osdp.split._build import ExtensionUnavailable
from osdp.split._extension import (
    backend,
    build_extension,
    memory_stats,
    reset_peak_memory_stats,
    set_backend,
)
from osdp.split.linear import (
    MIN_SPLIT_NUMEL,
    SplitLinear,
    apply_split,
    split_layout,
    split_parameters,
    splittable_linears,
)

__all__ = [
    "ExtensionUnavailable",
    "MIN_SPLIT_NUMEL",
    "SplitLinear",
    "apply_split",
    "backend",
    "build_extension",
    "memory_stats",
    "reset_peak_memory_stats",
    "set_backend",
    "split_layout",
    "split_parameters",
    "splittable_linears",
]
