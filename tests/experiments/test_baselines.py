"""experiments/baselines.py: each baseline is what its name says and trains as one process does."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import baselines
from cases import build_reference, reference_batches  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from training_check import assert_matches_reference, reference  # noqa: E402

from osdp._torch_private import ddp_bucket_bytes  # noqa: E402

MODEL = "gpt2-tiny"


def _structure(model: nn.Module, blocks: nn.ModuleList) -> dict:
    """What a built baseline is made of, read from the objects themselves."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from osdp._torch_private import checkpoint_wrapper
    from osdp.distributed import collectives as comm

    wrapper_type = type(checkpoint_wrapper(nn.Linear(1, 1)))
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {
        "ddp": isinstance(model, DistributedDataParallel),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in inner.modules()),
        "sharded_blocks": sum(isinstance(b, FSDPModule) for b in blocks),
        "root_sharded": isinstance(inner, FSDPModule),
        "checkpointed_blocks": sum(isinstance(b, wrapper_type) for b in blocks),
        # per-op selective: the wrapper's checkpoint runs with a context_fn (the policy)
        "selective_blocks": sum(isinstance(b, wrapper_type) and "context_fn" in b.checkpoint_fn.keywords
                                for b in blocks),
        "pairwise": comm.uses_pairwise(inner) and comm.uses_pairwise(inner, "all_gather"),
        "bucket_bytes": ddp_bucket_bytes(model) if isinstance(model, DistributedDataParallel) else 0,
    }


def _sharded_after_forward(model: nn.Module, blocks: nn.ModuleList, batch) -> list[bool]:
    """Per block: are its registered parameters sharded DTensors between forward and backward?"""
    from torch.distributed.tensor import DTensor

    loss = model(*batch)
    sharded = [all(isinstance(p, DTensor) for p in b.parameters()) for b in blocks]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sharded


def _build_and_train(rank, world_size, batches):
    from training_check import full_state, train

    from osdp.distributed import collectives as comm

    comm.set_reduce_scatter("pairwise")  # the experiments' settings; the native ones are FSDP2's defaults
    comm.set_all_gather("pairwise")
    out = {}
    for name in baselines.BASELINES:
        model = build_reference(MODEL)
        blocks = baselines.transformer_blocks(model)
        built = baselines.build_baseline(name, model, "cpu")
        info = _structure(built, blocks)
        info["n_blocks"] = len(blocks)
        if not info["ddp"]:
            probe = build_reference(MODEL)
            probe_blocks = baselines.transformer_blocks(probe)
            probe = baselines.build_baseline(name, probe, "cpu")
            n = batches[0][0].shape[0] // world_size
            info["sharded_after_forward"] = _sharded_after_forward(
                probe, probe_blocks, [t[rank * n:(rank + 1) * n] for t in batches[0]])
        losses = train(built, batches, rank, world_size)
        state = full_state(built)  # collective: every rank takes part
        out[name] = (losses, state if rank == 0 else None, info)
    return out


def test_each_baseline_is_what_its_name_says_and_trains_like_one_process():
    batches = reference_batches(MODEL)
    out = run_ranks(_build_and_train, 2, batches, timeout=300)
    build = functools.partial(build_reference, MODEL)
    params = sum(p.numel() * 4 for p in build().parameters())
    for name in baselines.BASELINES:
        info = out[0][name][2]
        n = info["n_blocks"]
        assert n == 2
        checkpointed = {"ac": n, "sac": n, "ac2": n // 2}.get(name.partition("+")[2], 0)  # ac2: every second
        assert info["checkpointed_blocks"] == checkpointed, name
        assert info["selective_blocks"] == (n if name.endswith("+sac") else 0), name
        if name.startswith("torch-ddp"):
            assert info["ddp"] and info["fsdp_modules"] == 0, name
            assert info["bucket_bytes"] == params, name  # DDP's buckets, counted by osdp.machine.memory: all gradients
        else:
            # one fully_shard per block, then the root
            assert not info["ddp"] and info["sharded_blocks"] == n and info["root_sharded"], name
            assert info["fsdp_modules"] == n + 1 and info["pairwise"], name
            # FSDP2's defaults reshard blocks after forward; ZeRO-2 keeps them gathered until backward
            assert info["sharded_after_forward"] == [not name.startswith("fsdp2-zero2")] * n, name
    per_rank = [[out[r][name][:2] for name in baselines.BASELINES] for r in range(2)]
    assert_matches_reference(per_rank, reference(build, batches), list(baselines.BASELINES))


def _hybrid_on_two_nodes(rank, world_size, batches):
    """The HSDP baselines on 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2, as torchrun sets it on each node)."""
    from training_check import full_state, train

    from osdp.distributed import collectives as comm

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    comm.set_reduce_scatter("pairwise")
    comm.set_all_gather("pairwise")  # over each node's shard group
    out = {}
    for name in ("fsdp2-hsdp", "fsdp2-hsdp+ac"):
        model = build_reference(MODEL)
        blocks = baselines.transformer_blocks(model)
        built = baselines.build_baseline(name, model, "cpu")
        info = _structure(built, blocks)
        info["n_blocks"] = len(blocks)
        # every parameter's mesh: its ranks, dimension names and placements
        info["meshes"] = {(str(p.device_mesh.mesh.tolist()), p.device_mesh.mesh_dim_names,
                           tuple(str(x) for x in p.placements)) for p in built.parameters()}
        losses = train(built, batches, rank, world_size)
        state = full_state(built)  # collective: every rank takes part
        out[name] = (losses, state if rank == 0 else None, info)
    return out


def test_hybrid_sharding_baselines_on_two_nodes_are_hsdp_and_train_like_one_process():
    batches = reference_batches(MODEL)
    out = run_ranks(_hybrid_on_two_nodes, 4, batches, timeout=300)
    names = ["fsdp2-hsdp", "fsdp2-hsdp+ac"]
    assert set(names) <= set(baselines.MULTI_NODE_BASELINES) and not set(names) & set(baselines.BASELINES)
    for name in names:
        info = out[0][name][2]
        n = info["n_blocks"]
        # one fully_shard per block, then the root, all on the (nodes, ranks per node) mesh: node i is row i,
        # parameters replicated across the rows and sharded along them
        assert not info["ddp"] and info["sharded_blocks"] == n and info["root_sharded"], name
        assert info["fsdp_modules"] == n + 1 and info["pairwise"], name
        assert info["meshes"] == {("[[0, 1], [2, 3]]", ("replicate", "shard"), ("R", "S(0)"))}, name
        assert info["checkpointed_blocks"] == (n if name.endswith("+ac") else 0), name
    per_rank = [[out[r][name][:2] for name in names] for r in range(4)]
    assert_matches_reference(per_rank, reference(functools.partial(build_reference, MODEL), batches), names)


def test_transformer_blocks_of_a_hugging_face_model_and_a_model_without_blocks():
    from hf_models import hf_model

    model = hf_model("gpt2")
    assert baselines.transformer_blocks(model) is model.hf.transformer.h
    with pytest.raises(ValueError, match="no list of transformer blocks"):
        baselines.transformer_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ValueError, match="unknown baseline 'ddp'"):
        baselines.build_baseline("ddp", build_reference(MODEL))


def _collectives_per_step(rank, world_size, batches):
    """All-gathers and reduce-scatters in one training step (after a first one): OSDP's zero3 and zero2
    plans in whole blocks, as the search takes them when memory is no limit, and their native twins."""
    from training_check import train

    import osdp
    from osdp.distributed import collectives as comm
    from osdp.schema.plan import Plan

    comm.set_reduce_scatter("pairwise")
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counting(name, collective):
        def counted(*args, **kwargs):
            counts[name] += 1
            return collective(*args, **kwargs)
        return counted

    comm.native_all_gather = counting("all_gather", comm.native_all_gather)  # under every FSDP2 all-gather
    comm.reduce_scatter = counting("reduce_scatter", comm.reduce_scatter)
    out = {}
    for strategy, native in (("fsdp", "fsdp2"), ("zero2", "fsdp2-zero2")):
        model = build_reference(MODEL)
        paths = [u.path for u in osdp.discover_units(model, granularity="block")]
        twins = {strategy: osdp.wrap(model, plan=Plan.for_strategy(paths, strategy)),
                 native: baselines.build_baseline(native, build_reference(MODEL), "cpu")}
        for name, built in twins.items():
            train(built, batches[:1], rank, world_size)
            before = dict(counts)
            train(built, batches[1:2], rank, world_size)
            out[name] = {k: counts[k] - before[k] for k in counts}
    return out


def test_osdp_in_whole_blocks_makes_the_collectives_of_per_block_fully_shard():
    # the position embedding stays with the root (not a unit of its own) and a zero3 root is not gathered
    # again for backward: one all-gather per step, as FSDP2 keeps its root
    batches = reference_batches(MODEL)
    out = run_ranks(_collectives_per_step, 2, batches, timeout=300)[0]
    blocks = 2
    assert out["fsdp"] == out["fsdp2"] == {"all_gather": 2 * blocks + 1, "reduce_scatter": blocks + 1}, out
    assert out["zero2"] == out["fsdp2-zero2"] == {"all_gather": blocks + 1, "reduce_scatter": blocks + 1}, out


def test_osdp_selective_policy_keeps_what_torchtitans_keeps():
    """OSDP's selective checkpointing decides as the fsdp2+sac and torch-ddp+sac baselines (torchtitan's default
    policy) on a transformer block's ops: their plans are in OSDP's space."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from osdp.describe.recompute import selective_context

    aten = torch.ops.aten
    block = [aten.native_layer_norm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten.addmm.default, aten.add.Tensor, aten.native_layer_norm.default, aten.addmm.default, aten.gelu.default,
             aten.addmm.default, aten.add.Tensor]

    class Ctx:
        def __init__(self, is_recompute):
            self.is_recompute = is_recompute

    def decisions(context_fn) -> list[CheckpointPolicy]:
        # the recompute asks the policy again on torch versions whose recompute mode keeps it (newer ones replay
        # the forward's decisions)
        modes = [mode for mode in context_fn() if hasattr(mode, "policy_fn")]
        return [mode.policy_fn(Ctx(i == 1), op) for i, mode in enumerate(modes) for op in block]

    ours, torchtitans = decisions(selective_context), decisions(baselines._selective_per_op)
    assert ours == torchtitans
    kept = [op for op, d in zip(block, ours[:len(block)]) if d == CheckpointPolicy.MUST_SAVE]
    assert kept == [aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default, aten.addmm.default]
