"""torch.compile over a wrapped model, per unit (``osdp.compile_units``) and whole (``model.compile``), and a model
compiled before it was wrapped (``osdp.wrap(torch.compile(model))``): every
plan kind (DDP, zero2, FSDP, two mixed plans with checkpointing, split) trains equal to one process, with
graphs really compiled; SplitLinear runs eagerly between them.

The backend is ``aot_eager``: Dynamo's tracing and AOTAutograd's joint graph, which is where compilation
meets FSDP2's hooks, DDP's reducer and checkpointing; Inductor only generates the kernels (too slow to build
for a test on 2 cores; ``experiments/compile_bench.py`` uses it)."""

from __future__ import annotations

import pytest
import torch
from cases import build_toy, every_mode_plans, toy_batches
from dist_harness import run_ranks
from training_check import assert_matches_reference, full_state, reference, train

import osdp


def train_compiled(rank, world_size, plans_json, how):
    from torch._dynamo.utils import counters

    results = []
    for plan_json in plans_json:
        torch._dynamo.reset()
        if how == "before":  # torch.compile first, as most scripts write it: osdp.wrap returns it compiled
            model = osdp.wrap(torch.compile(build_toy(), backend="aot_eager"), plan=plan_json)
            assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
            assert osdp.plan_of(model).hash == osdp.Plan.from_json(plan_json).hash
        else:
            model = build_toy()
            osdp.wrap(model, plan=plan_json)
        if how == "units":
            compiled = osdp.compile_units(model, backend="aot_eager")
            assert compiled and "" not in compiled
        elif how == "model":
            model.compile(backend="aot_eager")
        counters.clear()
        losses = train(model, toy_batches(), rank, world_size)
        graphs = counters["stats"]["unique_graphs"]
        state = full_state(getattr(model, "_orig_mod", model))  # collective: every rank takes part
        results.append((losses, state if rank == 0 else None, graphs))
    return results


@pytest.mark.parametrize("how", ["units", "model", "before"])
def test_compiled_training_matches_single_process(how):
    plans = every_mode_plans(build_toy())
    assert {"mixed_a", "split"} <= set(plans)
    out = run_ranks(train_compiled, 2, [p.to_json() for p in plans.values()], how, timeout=600)
    assert_matches_reference(out, reference(build_toy, toy_batches()), list(plans))
    for i, (name, plan) in enumerate(plans.items()):
        if how in ("model", "before") and plan.unit("").checkpoint:
            # mixed_b checkpoints the root: one checkpointed region around the whole forward, which Dynamo
            # cannot break around FSDP2's hooks inside, so it runs eagerly (the search never checkpoints a
            # unit enclosing others; compile_units compiles the units inside it)
            continue
        assert out[0][i][2] > 0, f"{name}: nothing was compiled"


def test_compile_units_needs_a_wrapped_model():
    with pytest.raises(ValueError, match="not been wrapped"):
        osdp.compile_units(build_toy())


def _searched_after_compiling(rank, world_size):
    torch._dynamo.reset()
    inputs, targets = (t.chunk(world_size)[rank] for t in toy_batches()[0])
    model = osdp.wrap(torch.compile(build_toy(), backend="aot_eager"), device_mem="1GiB",
                      example_input=(inputs, targets), planning_device="cpu-loopback")
    losses = train(model, toy_batches(), rank, world_size)
    state = full_state(model._orig_mod)  # collective: every rank takes part
    return losses, state if rank == 0 else None


def test_a_model_compiled_before_a_search_trains_as_one_process():
    """A searched plan measures its first step (``fsdp_ext.budget_check``) from a hook the compiled model's frame
    runs: traced, it failed in AOTAutograd (a graph made for the parameters' class before they became
    assignable)."""
    out = run_ranks(_searched_after_compiling, 2, timeout=600)
    assert_matches_reference([[r] for r in out], reference(build_toy, toy_batches()), ["searched, compiled first"])
