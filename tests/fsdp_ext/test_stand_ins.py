"""Modules the plan did not make units answer FSDP2's methods for the units that hold their parameters.

A user of FSDP2 calls its methods on the modules they ``fully_shard``-ed: the blocks, the embedding, the heads.
Under osdp's plans a block may be one unit (block granularity), or hold units (its attention and MLP), and an
embedding may be a unit or sit inside the root. Whichever, the module has FSDP2's methods, they act on the units
standing behind it (gathering, resharding, prefetching), and the module stays what it was (its class, its name,
no ``FSDPModule``). That such calls train as one process under every plan is the contract matrix's
(``test_contract.py``, behaviours ``titan`` and ``summed``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_harness import run_ranks
from test_contract import Block, build, ce
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import osdp
from osdp.schema.plan import Plan

FSDP2_METHODS = [name for name, f in vars(FSDPModule).items()
                 if callable(f) and not name.startswith("_") and name != "reset_iter_state"]


def _plan(granularity: str) -> str:
    paths = [u.path for u in osdp.discover_units(build(), granularity=granularity)]
    return Plan.for_strategy(paths, "fsdp").to_json()


def _gathered(unit: nn.Module) -> bool:
    """Whether FSDP2 has this unit's parameters gathered or an all-gather of them issued (its state's)."""
    group = fully_shard.state(unit)._fsdp_param_group
    return group.is_unsharded or group._all_gather_result is not None


def _units(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _methods_and_gathering(rank, world_size, granularity):
    model = build()
    osdp.wrap(model, plan=_plan(granularity))
    block = model.blocks[0]
    report = {
        "block_is_unit": isinstance(block, FSDPModule),
        "embedding_is_unit": isinstance(model.wte, FSDPModule),
        "methods": {name: all(callable(getattr(m, name, None)) for m in [model.wte, *model.blocks, model.head])
                    for name in FSDP2_METHODS},
        # a unit and a block the plan took apart alike keep the user's class name (not FSDP2's FSDP<name>)
        "still_a_block": isinstance(block, Block) and type(block).__name__ == "Block",
    }

    def sharded():  # FSDP2 registers other Parameter objects as it gathers and reshards: read them each time
        return [isinstance(p, DTensor) for p in [*block.attn.parameters(), *block.mlp.parameters()]]

    block.unshard()
    report["unsharded"] = not any(sharded())
    block.reshard()
    report["resharded"] = all(sharded())
    handle = block.unshard(async_op=True)
    handle.wait()
    report["unsharded_async"] = not any(sharded())
    block.reshard()
    try:
        block.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
        report["foreign_prefetch"] = None
    except ValueError as e:
        report["foreign_prefetch"] = str(e)
    return report


@pytest.mark.parametrize("granularity", ["sub-block", "block"])
def test_blocks_and_embeddings_answer_fsdp2s_methods_whether_units_or_not(granularity):
    for report in run_ranks(_methods_and_gathering, 2, granularity, timeout=120):
        assert report["block_is_unit"] == (granularity == "block")
        assert report["embedding_is_unit"] == (granularity == "sub-block")  # the root holds it at block granularity
        assert all(report["methods"].values()), [n for n, ok in report["methods"].items() if not ok]
        assert report["still_a_block"]
        assert report["unsharded"] and report["resharded"] and report["unsharded_async"]
        assert "not a module of a model osdp.wrap wrapped" in report["foreign_prefetch"]


def _prefetching(rank, world_size, prefetch):
    """Whether the second block's first unit is gathered (or its all-gather issued) as that block's forward
    begins, and the first block's last unit as the second block's backward begins; ``prefetch``: torchtitan's
    settings. The other units of a block are left to FSDP2's own prefetching, as the plan priced them."""
    torch.manual_seed(0)
    model = build()
    osdp.wrap(model, plan=_plan("sub-block"))  # zero3: every block's attention and MLP units resharded
    first, second = model.blocks
    if prefetch:
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
    seen = {}
    second.register_forward_pre_hook(
        lambda m, args: seen.update(forward=_gathered(second.attn), rest=_gathered(second.mlp)))
    # the second block's backward begins at its MLP (before FSDP2's own prefetch, at its attention's)
    second.mlp[2].register_full_backward_pre_hook(lambda m, grad: seen.update(backward=_gathered(first.mlp)))
    x = torch.randint(0, 128, (2, 8))
    logits, aux = model(x)
    (ce(logits, x) + ce(aux, x)).backward()
    return seen


def test_prefetching_a_block_the_plan_took_apart_gathers_its_first_unit_ahead():
    without, with_prefetch = (run_ranks(_prefetching, 2, p, timeout=120)[0] for p in (False, True))
    assert without == {"forward": False, "rest": False, "backward": False}  # each unit at its own hooks
    assert with_prefetch == {"forward": True, "rest": False, "backward": True}


def _divide_factor_warnings(rank, world_size, granularity):
    """The warnings of the forward after each way of setting a divide factor of 1: on the blocks only, on the
    embedding only, and then on every module a user would wrap (the model itself included)."""
    import warnings

    from test_contract import _fully_shardable

    from osdp.fsdp_ext.divide_factors import DivideFactorWarning

    x = torch.randint(0, 128, (2, 8))
    out = {}
    for name, modules in (("blocks", lambda m: list(m.blocks)), ("embedding", lambda m: [m.wte]),
                          ("every module", _fully_shardable)):
        model = build()
        osdp.wrap(model, plan=_plan(granularity))
        for module in modules(model):
            module.set_gradient_divide_factor(1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x)
        out[name] = [str(w.message) for w in caught if issubclass(w.category, DivideFactorWarning)]
    return out


@pytest.mark.parametrize("granularity", ["sub-block", "block"])
def test_a_divide_factor_its_units_cannot_follow_is_said_at_the_next_forward(granularity):
    report = run_ranks(_divide_factor_warnings, 2, granularity, timeout=120)[0]
    assert report["every module"] == []  # as FSDP2 users set it: every plan divides alike
    if granularity == "sub-block":  # the blocks' norms are the root's
        (message,) = report["blocks"]
        assert message.startswith("osdp: the gradients of blocks.0.ln.weight, blocks.0.ln.bias, blocks.1.ln.weight, "
                                  "blocks.1.ln.bias are divided by the number of ranks, where 1 was set for them: the "
                                  "plan made their module no unit of its own, and unit '<root>' holds them with other "
                                  "parameters"), message
        assert report["embedding"] == []  # the embedding is a unit of its own
    else:  # each block is a unit, its norms in it; the embedding is the root's, with the heads
        assert report["blocks"] == []
        (message,) = report["embedding"]
        assert message.startswith("osdp: the gradients of head.weight, head.bias, aux.weight, aux.bias and "), message
        assert "are divided by 1, where none was set for them (the default: the number of ranks)" in message
