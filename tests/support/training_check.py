"""Shared by the multi-rank tests: train under a plan on N ranks and against one process."""

from __future__ import annotations

import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import osdp

STEPS = 3


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def train(model, batches, rank: int = 0, world_size: int = 1, optimizer=None) -> list[float]:
    """Train on each rank's slice of every global batch (SGD with momentum unless ``optimizer``
    is given); returns this rank's losses."""
    opt = optimizer if optimizer is not None else sgd(model)
    losses = []
    for inputs, targets in batches:
        n = inputs.shape[0] // world_size
        loss = model(inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def plan_kinds(model) -> dict:
    """The plans a test trains a foreign model under: the three baselines, and a mixed plan (every mode in turn,
    every other unit checkpointed, the root among them)."""
    from osdp.schema.plan import Plan, UnitPlan

    paths = [u.path for u in osdp.discover_units(model)]
    modes = ["replicate", "zero2", "zero3"]
    plans = {s: Plan.for_strategy(paths, s) for s in ("ddp", "zero2", "fsdp")}
    plans["mixed"] = Plan([UnitPlan(p, modes[i % 3], checkpoint=i % 2 == 1) for i, p in enumerate(paths)])
    return plans


def cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's tensors copied out of the model (training on does not change them)."""
    return {k: v.detach().clone() for k, v in state.items()}


def full_state(model) -> dict[str, torch.Tensor]:
    return cloned(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))  # every rank


def reference(build, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    losses = train(model, batches)
    return losses, cloned(model.state_dict())


def train_under_plans(rank, world_size, build, batches, plans_json):
    """On every rank: for each plan, build the same model, wrap, train; return losses and full state."""
    return run_under_plans(rank, build, plans_json, lambda model: train(model, batches, rank, world_size))


def run_under_plans(rank, build, plans_json, run):
    """On every rank: for each plan, build the same model, wrap, ``run(model)``; return what it returned and
    rank 0's full state."""
    results = []
    for plan_json in plans_json:
        model = build()
        osdp.wrap(model, plan=plan_json)
        out = run(model)
        state = full_state(model)  # collective: every rank takes part
        results.append((out, state if rank == 0 else None))
    return results


def assert_matches_reference(per_rank_results, ref, plan_names, atol=1e-5, loss_rtol=0.0):
    """Every plan's losses (mean over ranks) and rank 0's full parameters within ``atol`` of one process;
    losses also within ``loss_rtol`` of the reference loss (for low-precision losses, whose resolution grows
    with their magnitude)."""
    ref_losses, ref_state = ref
    world_size = len(per_rank_results)
    for i, name in enumerate(plan_names):
        rank_losses = [per_rank_results[r][i][0] for r in range(world_size)]
        global_losses = [sum(step) / world_size for step in zip(*rank_losses)]
        loss_err = max(abs(a - b) for a, b in zip(global_losses, ref_losses))
        loss_ok = all(abs(a - b) <= atol + loss_rtol * abs(b) for a, b in zip(global_losses, ref_losses))
        state = per_rank_results[0][i][1]
        assert set(state) == set(ref_state), f"{name}: state dict keys differ"
        param_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        _record_differences(name, loss_err, param_err)
        assert loss_ok, f"{name}: loss differs from single-process training by {loss_err:.2e}"
        assert param_err <= atol, f"{name}: parameters differ from single-process training by {param_err:.2e}"


def _record_differences(plan_name: str, loss_err: float, param_err: float) -> None:
    """With OSDP_RECORD_DIFFERENCES=FILE, append one JSON line per compared plan (the test, the plan, its
    largest loss and parameter differences): the closing reports' equality matrices come from here."""
    path = os.environ.get("OSDP_RECORD_DIFFERENCES")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "plan": plan_name, "loss_diff": loss_err, "param_diff": param_err}) + "\n")
