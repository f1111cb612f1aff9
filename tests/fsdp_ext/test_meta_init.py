"""A model built on the meta device, wrapped, then given memory and values: FSDP2's (and torchtitan's) way for
models that do not fit one rank.

``with torch.device("meta"): model = Net()``, ``osdp.wrap(model, ...)``, ``model.to_empty(device=...)``, then
the user's initialisation or a loaded checkpoint. Under every kind of plan the model then trains as one process
that started from the same values; initialised at random with each rank's own seed, its replicated parameters
still start alike (rank 0's, at the first forward); with ``device_mem`` the search describes it from its
shapes. A forward before ``to_empty`` and ranks that built the model differently are told so on every rank.
torchtitan's recipe as a whole (blocks checkpointed before wrapping, built on meta, loaded, prefetching block
by block, accumulating) trains as one process too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from dist_harness import run_ranks
from test_contract import ContractNet, _assert_matrix, batches, build, plans, run_behaviour
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from training_check import full_state

import osdp
from osdp.schema.plan import Plan, PlanError, UnitPlan

PLANS = ("replicate", "zero2", "zero3", "split", "mixed", "selective", "grouped")
BEHAVIOURS = ("plain", "accumulate")


def _on_meta() -> ContractNet:
    with torch.device("meta"):
        return ContractNet()


def _load_full(model):
    """Values from a checkpoint of the model built on a real device, as torchtune loads one (a full state dict,
    every rank's copy, laid out by ``set_model_state_dict``)."""
    set_model_state_dict(model, build().state_dict(), options=StateDictOptions(full_state_dict=True))


def _train_from_meta(rank, world_size, plan_jsons, steps):
    out = {}
    for plan_name, plan_json in plan_jsons.items():
        for name in BEHAVIOURS:
            model = _on_meta()
            osdp.wrap(model, plan=plan_json)
            model.to_empty(device="cpu")
            _load_full(model)
            losses = run_behaviour(model, name, steps, rank, world_size, check=osdp.check_replicas)
            state = full_state(model)  # collective: every rank takes part
            out[(plan_name, name)] = (losses, state if rank == 0 else None)
    return out


def test_a_model_built_on_the_meta_device_trains_as_one_process_under_every_plan():
    every = plans()
    steps = batches()
    per_rank = run_ranks(_train_from_meta, 2, {n: every[n].to_json() for n in PLANS}, steps, timeout=300)
    _assert_matrix(per_rank, steps)


def _initialised_per_rank(rank, world_size, plan_json):
    """torchtitan's initialisation after ``to_empty``, each rank seeded apart (the worst case): FSDP2's shards
    are each rank's own draw, the replicated parameters rank 0's once the model runs."""
    torch.manual_seed(100 + rank)
    model = _on_meta()
    osdp.wrap(model, plan=plan_json)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
    model.forwards.zero_()
    x = torch.randint(0, 128, (2, 8))
    logits, aux = model(x)
    (logits.sum() + aux.sum()).backward()
    osdp.check_replicas(model)  # raises unless every replicated parameter is alike on every rank
    state = full_state(model)
    return {k: v.float().abs().sum().item() for k, v in state.items()}


def test_initialised_at_random_after_wrapping_its_replicas_start_alike():
    every = plans()
    for plan_name in ("replicate", "mixed"):
        per_rank = run_ranks(_initialised_per_rank, 2, every[plan_name].to_json(), timeout=120)
        assert per_rank[0] == per_rank[1], plan_name  # one model: every rank sees the same full values
        assert all(v > 0 for k, v in per_rank[0].items() if k.endswith("weight")), plan_name  # not left empty


def _scalar(output):
    logits, aux = output
    return logits.float().mean() + aux.float().mean()


def _searched(rank, world_size, steps):
    model = _on_meta()
    example = steps[0][0][0][: steps[0][0][0].shape[0] // world_size]
    osdp.wrap(model, device_mem="64MiB", example_input=example, loss_fn=_scalar, check_budget=False)
    plan = osdp.plan_of(model)
    model.to_empty(device="cpu")
    _load_full(model)
    losses = run_behaviour(model, "plain", steps, rank, world_size, check=osdp.check_replicas)
    state = full_state(model)  # collective: every rank takes part
    return {("searched", "plain"): (losses, state if rank == 0 else None)}, plan.to_json()


def test_a_budget_plans_a_model_on_the_meta_device_from_its_shapes():
    steps = batches()
    results = run_ranks(_searched, 2, steps, timeout=300)
    _assert_matrix([r[0] for r in results], steps)
    assert results[0][1] == results[1][1]  # one plan, rank 0's


def _forgotten(rank, world_size, plan_json):
    model = _on_meta()
    osdp.wrap(model, plan=plan_json)
    try:
        model(torch.randint(0, 128, (2, 8)))
    except RuntimeError as e:
        return str(e)
    return None


def _built_apart(rank, world_size):
    messages = []
    for how in (dict(strategy="fsdp"), dict(device_mem="64MiB", example_input=torch.randint(0, 128, (2, 8)),
                                           loss_fn=_scalar)):
        model = _on_meta() if rank == 1 else build()
        try:
            osdp.wrap(model, **how)
            messages.append(None)
        except PlanError as e:
            messages.append(str(e))
    return messages


def _routed_on_meta(rank, world_size):
    """A mixture of experts calling the experts its router chose: which ones run depends on values a model on
    the meta device does not have, so no search can price it from its shapes."""
    from model_styles import RoutedMoE, _tokens

    with torch.device("meta"):
        model = RoutedMoE()
    try:
        osdp.wrap(model, device_mem="64MiB", example_input=_tokens(4, torch.Generator().manual_seed(rank)))
    except ValueError as e:
        return str(e)
    return None


def test_a_forward_before_to_empty_a_routed_model_and_ranks_built_apart_are_told_on_every_rank():
    every = plans()
    for plan_name in ("replicate", "zero3"):
        for message in run_ranks(_forgotten, 2, every[plan_name].to_json(), timeout=120):
            assert message is not None and message.startswith("the model is still on the meta device ("), message
            assert "call model.to_empty(device=...) and initialise its parameters" in message
    for message in run_ranks(_routed_on_meta, 2, timeout=120):
        assert "the forward depends on the values of the data, as routing to experts does" in message
        assert message.endswith("The model is on the meta device, with no values to run: build it on a real "
                                "device for osdp to measure it, or wrap it with a plan")
    for messages in run_ranks(_built_apart, 2, timeout=120):  # a baseline, and a search before it describes
        assert messages == 2 * ["rank(s) [1] built the model on the meta device and rank(s) [0] on a real one: "
                                "build it alike on every rank"]


# -- torchtitan's recipe, whole --------------------------------------------------------------------------------


def _with_checkpointed_blocks(model: ContractNet) -> ContractNet:
    """torchtitan's activation checkpointing, applied before wrapping: every block in a ``checkpoint_wrapper``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def _recipe_plans() -> dict[str, str]:
    model = _with_checkpointed_blocks(build())
    modes = ["replicate", "zero2", "zero3"]
    fine = [u.path for u in osdp.discover_units(model)]
    whole = [u.path for u in osdp.discover_units(model, granularity="block")]
    return {"mixed": Plan([UnitPlan(p, modes[i % 3], split=2 if p.endswith("mlp") and i % 3 == 2 else 1)
                           for i, p in enumerate(fine)]).to_json(),
            "blocks": Plan.for_strategy(whole, "fsdp").to_json()}


def _torchtitan(rank, world_size, plan_jsons, steps):
    """Built on meta with its blocks checkpointed, wrapped, given memory, loaded, prefetching block by block
    and accumulating gradients: torchtitan's training script with osdp.wrap where it calls fully_shard."""
    out = {}
    for plan_name, plan_json in plan_jsons.items():
        with torch.device("meta"):
            model = _with_checkpointed_blocks(ContractNet())
        osdp.wrap(model, plan=plan_json)
        model.to_empty(device="cpu")
        _load_full(model)
        losses = run_behaviour(model, "titan", steps, rank, world_size, check=osdp.check_replicas)
        state = full_state(model)  # collective: every rank takes part
        out[(plan_name, "titan")] = (losses, state if rank == 0 else None)
    return out


def test_torchtitans_recipe_trains_as_one_process():
    steps = batches()
    per_rank = run_ranks(_torchtitan, 2, _recipe_plans(), steps, timeout=300)
    _assert_matrix(per_rank, steps)
