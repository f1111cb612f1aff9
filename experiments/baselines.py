"""The experiments' baselines: data parallelism as a PyTorch user writes it, without OSDP's planner.

    from baselines import BASELINES, build_baseline
    model = build_baseline("fsdp2+ac", model, "cpu")   # train the module it returns

``BASELINES`` (one node) and ``MULTI_NODE_BASELINES`` (several), each what
its name says, built from PyTorch alone (no ``osdp.wrap``, no
``apply_plan``, no plan):

- ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its
  defaults (25 MiB gradient buckets, all-reduces overlapped with backward);
- ``fsdp2``: ``fully_shard`` on each transformer block, then on the root,
  FSDP2's defaults otherwise (blocks reshard after forward, the root does
  not), as torchtitan applies it;
- ``fsdp2-zero2``: the same with ``reshard_after_forward=False`` everywhere
  (ZeRO-2: gathered parameters kept from forward to backward);
- ``fsdp2-hsdp``: FSDP2's hybrid sharding as torchtitan applies it:
  ``fully_shard`` on each block, then on the root, over a 2-D mesh
  (nodes, ranks per node) named ("replicate", "shard"): parameters sharded
  within each node, replicated across nodes; gradients reduce-scattered
  within the node, then all-reduced across nodes. The node layout is
  torchrun's (``LOCAL_WORLD_SIZE``, read by ``osdp.distributed.ranks_per_node``);
- ``torch-ddp+ac``, ``fsdp2+ac``, ``fsdp2-zero2+ac``, ``fsdp2-hsdp+ac``: each
  with full activation checkpointing of every block first
  (``checkpoint_wrapper``, non-reentrant), torchtitan's "full" AC;
- ``fsdp2+ac2``: per-layer checkpointing of every second block (the 2nd, 4th, ...), torchtitan's
  "selective" layer mode at frequency 2;
- ``fsdp2+sac``, ``torch-ddp+sac``: per-op selective checkpointing of every block, torchtitan's default
  AC: each block under ``checkpoint_wrapper`` with a ``create_selective_checkpoint_contexts`` policy that
  keeps the outputs of the matmuls but every second one, of attention and of ``max``, and recomputes the
  rest. torchtitan lists ``aten.mm`` for its matmuls (its Llama's Linears have no bias); a GPT-2 Linear
  with a bias is an ``aten.addmm``, which is listed here too.

A transformer block is an entry of the model's block list
(:func:`transformer_blocks`): the reference models' ``model.blocks``, and in
Hugging Face models ``transformer.h``, ``model.layers``, ``encoder.layer``...

One experiment setting applies to them as to OSDP's runs: the reduce-scatter
of ``osdp.distributed.collectives`` (``OSDP_REDUCE_SCATTER``), installed on the ``fully_shard``-ed
modules, so that every strategy's reductions are charged alike (FSDP2's own
unless the setting is ``pairwise``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from osdp._torch_private import checkpoint_wrapper
from osdp.distributed import collectives as comm
from osdp.describe.recompute import selective_context
from osdp.distributed import ranks_per_node

# one node: the single-node experiments (sweep.py, bench_modes.py)
BASELINES = ("torch-ddp", "fsdp2", "fsdp2-zero2", "torch-ddp+ac", "fsdp2+ac", "fsdp2-zero2+ac",
             "fsdp2+sac", "fsdp2+ac2", "torch-ddp+sac")
# several nodes (sweep_nodes.py): ZeRO-2 gives way to hybrid sharding, the strategy people pick across nodes
MULTI_NODE_BASELINES = ("torch-ddp", "fsdp2", "fsdp2-hsdp", "torch-ddp+ac", "fsdp2+ac", "fsdp2-hsdp+ac")
ALL_BASELINES = tuple(dict.fromkeys(BASELINES + MULTI_NODE_BASELINES))
# not baselines a user runs, but the native twins of osdp's selectively checkpointed plans in bench_modes.py:
# per-op selective checkpointing of every block with osdp's own policy (osdp.describe.recompute.selective_context)
TWIN_BASELINES = ("fsdp2+sac-osdp", "torch-ddp+sac-osdp")


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks: of its ``nn.ModuleList``s whose entries are all of one class
    and each hold parameters, the one holding the most parameters."""
    candidates = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1 \
                and all(next(b.parameters(), None) is not None for b in m):
            candidates.append((sum(p.numel() for p in m.parameters()), path, m))
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no list of transformer blocks (an nn.ModuleList of modules of one class "
            "holding parameters, such as model.blocks or transformer.h): the baselines wrap each block"
        )
    return max(candidates, key=lambda c: c[0])[2]


def build_baseline(name: str, model: nn.Module, device_type: str = "cpu") -> nn.Module:
    """Make ``model`` data parallel as baseline ``name`` (one of ``ALL_BASELINES``); returns the module to train.

    ``model``: materialized on its device, the same initial weights on every
    rank. Collective over the default process group: call it on every rank.
    ``torch-ddp*`` returns a ``DistributedDataParallel`` around ``model``;
    ``fsdp2*`` returns ``model`` itself, now FSDP2 (in place, like
    ``fully_shard``). With ``+ac``, ``+ac2`` and ``+sac`` the blocks in the model's block list (every second
    one for ``+ac2``) are replaced by their checkpoint wrappers (state-dict keys do not change).
    """
    if name not in ALL_BASELINES + TWIN_BASELINES:
        raise ValueError(f"unknown baseline {name!r}; use one of {', '.join(ALL_BASELINES + TWIN_BASELINES)}")
    kind, _, ac = name.partition("+")
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        if ac == "ac" or (ac == "ac2" and i % 2 == 1):
            blocks[i] = checkpoint_wrapper(block)
        elif ac == "sac":
            blocks[i] = checkpoint_wrapper(block, context_fn=_selective_per_op)
        elif ac == "sac-osdp":
            blocks[i] = checkpoint_wrapper(block, context_fn=selective_context)
    if kind == "torch-ddp":
        device_ids = [torch.cuda.current_device()] if device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    mesh = data_parallel_mesh(device_type, hybrid=kind == "fsdp2-hsdp")
    options = {"reshard_after_forward": False} if kind == "fsdp2-zero2" else {}
    for block in blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    comm.install(model)
    return model


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_SAVED = _MATMULS | {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten.max.default,
}


def _selective_per_op():
    """torchtitan's per-op policy (see the module docstring): a fresh pair of contexts per checkpointed call,
    counting the matmuls in forward and in the recompute alike, so that both keep the same ones."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _MATMULS:
            counts["recompute" if ctx.is_recompute else "forward"] += 1
        count = counts["recompute" if ctx.is_recompute else "forward"]
        keep = op in _SAVED and not (op in _MATMULS and count % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def data_parallel_mesh(device_type: str, hybrid: bool = False) -> DeviceMesh:
    """The FSDP2 baselines' mesh: 1-D over the world, or with ``hybrid`` the 2-D (nodes, ranks per node)
    mesh of hybrid sharding, named ("replicate", "shard") as torchtitan's data-parallel dimensions are.
    Always explicit: with a gloo group on a machine with GPUs the default mesh would pick CUDA (DESIGN.md
    section 4)."""
    world_size = dist.get_world_size()
    if not hybrid:
        return init_device_mesh(device_type, (world_size,))
    per_node = ranks_per_node()  # torchrun numbers ranks node by node: node i is row i of the mesh
    return init_device_mesh(device_type, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))
