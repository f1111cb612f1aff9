"""The contract with the user's code (DESIGN.md section 9): whatever the plan, the same training.

A plan-independence matrix: each behaviour a training script may have (requires_grad changed after wrapping,
FSDP2's methods on the model, on units and on the modules a user would have ``fully_shard``-ed (torchtitan's
prefetching, whether the plan made them units or not; gradients summed over the ranks), gradient clipping,
parameters unused in some steps, a module never called, the model called twice per step, buffers,
unshard/reshard calls) under every kind of plan, on 2 gloo ranks, equal to one process training the global
batch (fp32 within 1e-5), and ``osdp.check_replicas`` after every step; grouped plans (both blocks one FSDP2
unit) among them. Node-scoped plans on 4 ranks (2 nodes of 2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cases import build_toy, every_mode_plans, toy_batches
from dist_harness import run_ranks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from training_check import assert_matches_reference, full_state, reference, run_under_plans, train

import osdp
from osdp.schema.plan import Plan, UnitPlan

STEPS = 3
ATOL = 1e-5


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.attn = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h))
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class ContractNet(nn.Module):
    """Embedding, two blocks, a head and an auxiliary head whose output a step may not use, a module never
    called, and a step-counting buffer."""

    def __init__(self, vocab=131, h=32):  # 131 rows: every sharding of them is padded
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList([Block(h) for _ in range(2)])
        self.head = nn.Linear(h, vocab)
        self.aux = nn.Linear(h, vocab)
        self.never_called = nn.Linear(h, h)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, idx):
        if self.training and torch.is_grad_enabled():
            self.forwards += 1
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x), self.aux(x)


def build():
    torch.manual_seed(0)
    return ContractNet()


def batches(global_batch=4, micro=2):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randint(0, 128, (global_batch, 8), generator=g), torch.randint(0, 128, (global_batch, 8), generator=g))
             for _ in range(micro)] for _ in range(STEPS)]


def ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def plans() -> dict[str, Plan]:
    model = build()
    paths = [u.path for u in osdp.discover_units(model)]
    modes = ["replicate", "zero2", "zero3"]
    split = [UnitPlan(p, "zero3", split=2) if p.endswith(("mlp", "head")) else UnitPlan(p, "zero3") for p in paths]
    return {
        "replicate": Plan.for_strategy(paths, "ddp"),
        "zero2": Plan.for_strategy(paths, "zero2"),
        "zero3": Plan.for_strategy(paths, "fsdp"),
        "split": Plan(split),
        "checkpointed": Plan([UnitPlan(p, "zero3", checkpoint=p.startswith("blocks")) for p in paths]),
        # selective checkpointing (matmul outputs kept, the rest recomputed) in every mode
        "selective": Plan([UnitPlan(p, modes[i % 3], checkpoint="selective" if p.startswith("blocks") else False)
                           for i, p in enumerate(paths)]),
        "mixed": Plan([UnitPlan(p, modes[i % 3], checkpoint=i % 2 == 1, split=2 if p.endswith("mlp") and
                                modes[i % 3] == "zero3" else 1) for i, p in enumerate(paths)]),
        "replicate_root": Plan([UnitPlan(p, "zero3" if p else "replicate") for p in paths]),
        # the two blocks one FSDP2 unit (fully_shard([blocks.0, blocks.1])), resharded after forward or kept
        "grouped": _grouped(model, "zero3", False),
        "grouped_zero2_ckpt": _grouped(model, "zero2", True),
    }


def _grouped(model, mode, checkpoint) -> Plan:
    blocks = ("blocks.0", "blocks.1")
    return Plan([UnitPlan(u.path, mode if u.path else "zero3", checkpoint=checkpoint and u.path in blocks,
                          group="blocks.0" if u.path in blocks else None)
                 for u in osdp.discover_units(model, granularity="block")])


# -- the behaviours: one training script each, run wrapped on N ranks and plain on one process ----------------


def _units(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def run_behaviour(model, name, steps, rank=0, world_size=1, check=None):
    """Train ``model`` with behaviour ``name`` on this rank's slice of every global batch; the losses."""
    wrapped = world_size > 1 or isinstance(model, FSDPModule)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []

    def mine(t):
        n = t.shape[0] // world_size
        return t[rank * n:(rank + 1) * n]

    for step, micro_batches in enumerate(steps):
        if name == "load_assigned" and step == 1:  # FSDP2's tutorial: load by assign, then make the optimizer
            _load_assigned(model, wrapped)
            opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if name == "unfreeze" and step == 1:
            model.blocks[0].attn.requires_grad_(True)
        if name == "freeze" and step == 1:
            model.blocks[1].requires_grad_(False)
        total = 0.0
        for m, (x, y) in enumerate(micro_batches):
            x, y = mine(x), mine(y)
            last = m == len(micro_batches) - 1
            if wrapped and name == "accumulate":  # FSDP2's gradient accumulation, on the root
                model.set_requires_gradient_sync(last)
            if wrapped and name == "accumulate_units":  # and unit by unit, as torchtitan writes it
                for unit in _units(model):
                    unit.set_requires_gradient_sync(last, recurse=False)
            if wrapped and name == "all_reduce":
                model.set_requires_all_reduce(last)
            if wrapped and name == "titan" and step == 0 and m == 0:
                _fsdp2_settings_per_block(model)
            if wrapped and name == "titan":  # accumulation block by block, and a block gathered ahead
                for module in [model.wte, *model.blocks, model.head, model.aux]:
                    module.set_requires_gradient_sync(last)
                model.set_requires_gradient_sync(last, recurse=False)
                if m == 0:
                    model.blocks[1].unshard(async_op=True)  # FSDP2 waits for it in the block's pre-forward
            if wrapped and name == "summed" and step == 0 and m == 0:
                for module in _fully_shardable(model):  # gradients summed over the ranks, not averaged
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # how FSDP2 reduces, not what
            if wrapped and name == "unshard":
                for unit in _units(model):
                    unit.unshard()
                model.set_reshard_after_backward(last)
            if name == "twice":  # the model called twice before one backward
                a, _ = model(x[:, :4])
                b, _ = model(x[:, 4:])
                loss = (ce(a, y[:, :4]) + ce(b, y[:, 4:])) / 2
            else:
                logits, aux = model(x)
                loss = ce(logits, y)
                if name != "unused_output" or step != 1:  # the auxiliary output unused in step 1
                    loss = loss + 0.5 * ce(aux, y)
            if name == "zero_after_forward" and m == 0:  # as Lightning's step: forward, zero_grad, backward
                opt.zero_grad()
            summed = SUMMED_OVER if name == "summed" and not wrapped else 1  # one process sums as the ranks do
            (loss * summed / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        if name == "clip_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if name == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        if name != "zero_after_forward":
            opt.zero_grad()
        losses.append(total)
        if check is not None:
            check(model)
    return losses


def _fully_shardable(model):
    """The modules a user of FSDP2 would ``fully_shard`` in this model: its embedding, blocks and heads, and the
    model itself. Under osdp's plans each of them is a unit, holds units or sits inside one."""
    return [model.wte, *model.blocks, model.head, model.aux, model.never_called, model]


def _fsdp2_settings_per_block(model):
    """torchtitan's explicit prefetching and resharding, written for a model whose blocks are each one unit:
    every block gathers the next in forward and the previous in backward, the embedding the first block, the
    last block the heads, and the last block keeps its parameters gathered for the backward that follows."""
    blocks = list(model.blocks)
    model.wte.set_modules_to_forward_prefetch([blocks[0]])
    for block, after in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([block])
    blocks[-1].set_modules_to_forward_prefetch([model.head, model.aux])
    blocks[0].set_modules_to_backward_prefetch([model.wte])
    model.head.set_modules_to_backward_prefetch([blocks[-1]])
    for block in blocks[:-1]:
        block.set_reshard_after_forward(True)
    blocks[-1].set_reshard_after_forward(False)


def _load_assigned(model, wrapped):
    """FSDP2's tutorial, under every plan: save the parameters' full values (``full_tensor()`` of every
    parameter's state-dict value), then load another model's weights by assigning them, each laid out as the
    model's own state dict shows it (``distribute_tensor`` on its mesh and placements). Buffers are plain
    tensors in FSDP2's state dicts too."""
    torch.manual_seed(5)
    full = ContractNet().state_dict()
    if wrapped:
        params = {name for name, _ in model.named_parameters()}
        saved = {k: v.full_tensor() for k, v in model.state_dict().items() if k in params}
        assert set(saved) == params
        laid_out = {}
        for key, like in model.state_dict().items():
            laid_out[key] = distribute_tensor(full[key], like.device_mesh, like.placements) if key in params else full[key]
        full = laid_out
    model.load_state_dict(full, assign=True)


BEHAVIOURS = ["plain", "load_assigned", "zero_after_forward", "unfreeze", "freeze", "accumulate", "accumulate_units",
              "all_reduce", "unshard", "titan", "summed", "twice", "unused_output", "clip_norm", "clip_value"]
SUMMED_OVER = 2  # the ranks "summed" runs on


def _frozen_at_wrap(model):
    model.blocks[0].attn.requires_grad_(False)  # unfrozen after step 1 by "unfreeze"


def _train_matrix(rank, world_size, plan_jsons, behaviours, steps):
    out = {}
    for plan_name, plan_json in plan_jsons.items():
        for name in behaviours:
            model = build()
            if name == "unfreeze":
                _frozen_at_wrap(model)
            osdp.wrap(model, plan=plan_json)
            losses = run_behaviour(model, name, steps, rank, world_size, check=osdp.check_replicas)
            # between steps every parameter is a DTensor, as in a fully_shard-ed model, whatever the plan, and
            # all on one mesh (torch.nn.utils.clip_grad_norm_ takes no mix of meshes)
            assert all(isinstance(p, DTensor) for p in model.parameters()), (plan_name, name)
            assert len({p.device_mesh for p in model.parameters()}) == 1, (plan_name, name)
            state = full_state(model)
            out[(plan_name, name)] = (losses, state if rank == 0 else None)
    return out


def _reference(name, steps):
    model = build()
    if name == "unfreeze":
        _frozen_at_wrap(model)
    losses = run_behaviour(model, name, steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_matrix(per_rank, steps):
    failures = []
    references = {}
    for (plan_name, name) in per_rank[0]:
        if name not in references:
            references[name] = _reference(name, steps)
        ref_losses, ref_state = references[name]
        losses = [sum(r[(plan_name, name)][0][i] for r in per_rank) / len(per_rank) for i in range(len(steps))]
        state = per_rank[0][(plan_name, name)][1]
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_err = max((state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state)
        if set(state) != set(ref_state) or loss_err > ATOL or param_err > ATOL:
            failures.append(f"{plan_name}/{name}: loss {loss_err:.1e}, parameters {param_err:.1e}")
    assert not failures, "differs from one process:\n" + "\n".join(failures)


@pytest.mark.parametrize("plan_names", [("replicate", "zero2", "zero3"), ("split", "checkpointed"),
                                        ("mixed", "replicate_root", "selective"), ("grouped", "grouped_zero2_ckpt")])
def test_every_behaviour_trains_as_one_process_under_every_plan(plan_names):
    every = plans()
    chosen = {n: every[n].to_json() for n in plan_names}
    steps = batches()
    per_rank = run_ranks(_train_matrix, 2, chosen, BEHAVIOURS, steps, timeout=600)
    _assert_matrix(per_rank, steps)


def _in_bf16(plan: Plan) -> Plan:
    settings = plan.to_dict()
    settings.pop("hash")
    return Plan.from_dict({**settings, "mixed_precision": "bf16"})


def test_every_behaviour_trains_alike_under_every_bf16_plan():
    """In bf16 one process computes otherwise than N ranks do (each rank's half of the batch rounds apart), so
    the plans are compared with each other: every behaviour, the sharded plan against replicated, mixed,
    checkpointed and grouped ones (replicated units FSDP2's replicate, a replicated root run as zero2).
    Unfreezing after wrapping and accumulating with a unit never called failed in FSDP2 under every bf16 plan
    (osdp.fsdp_ext.mixed_precision). Split Linears round their products apart from nn.Linear's
    (tests/runtime/test_training_loop.py) and are left out."""
    every = plans()
    names = ("zero3", "replicate", "zero2", "selective", "checkpointed", "replicate_root", "grouped_zero2_ckpt")
    chosen = {n: _in_bf16(every[n]).to_json() for n in names}
    steps = batches()
    per_rank = run_ranks(_train_matrix, 2, chosen, BEHAVIOURS, steps, timeout=600)
    failures = []
    for (plan_name, name), (losses, state) in per_rank[0].items():
        ref_losses, ref_state = per_rank[0][("zero3", name)]
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_err = max((state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state)
        if loss_err > ATOL or param_err > ATOL:
            failures.append(f"{plan_name}/{name}: loss {loss_err:.1e}, parameters {param_err:.1e}")
    assert not failures, "trained otherwise than the sharded plan in bf16:\n" + "\n".join(failures)


def _node_plans():
    paths = [u.path for u in osdp.discover_units(build())]
    return {
        "node_zero3": Plan([UnitPlan(p, "zero3", shard_scope="node") for p in paths], ranks_per_node=2),
        "node_mixed": Plan([UnitPlan(p, ("replicate", "zero2", "zero3")[i % 3], shard_scope="world" if i % 3 == 0
                                     else "node") for i, p in enumerate(paths)], ranks_per_node=2),
    }


def test_node_scoped_plans_train_as_one_process_on_two_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    chosen = {n: p.to_json() for n, p in _node_plans().items()}
    steps = batches(global_batch=8)
    per_rank = run_ranks(_train_matrix, 4, chosen, ["plain", "unfreeze", "accumulate_units", "unused_output",
                                                      "clip_norm", "clip_value"], steps, timeout=600)
    _assert_matrix(per_rank, steps)


# -- dropout: the same masks whatever the plan ---------------------------------------------------------------


class DropoutNet(ContractNet):
    """ContractNet with dropout after the embedding and inside every block's sub-blocks."""

    def __init__(self):
        super().__init__()
        for block in self.blocks:
            block.attn.insert(2, nn.Dropout(0.3))
            block.mlp.insert(2, nn.Dropout(0.3))
        self.drop = nn.Dropout(0.1)

    def forward(self, idx):
        x = self.drop(self.wte(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(x), self.aux(x)


def _train_with_dropout(rank, world_size, plan_jsons, steps):
    out = {}
    for plan_name, plan_json in plan_jsons.items():
        torch.manual_seed(0)
        model = DropoutNet()
        osdp.wrap(model, plan=plan_json)
        torch.manual_seed(100 + rank)  # each rank its own masks, the same under every plan
        losses = run_behaviour(model, "plain", steps, rank, world_size)
        state = full_state(model)
        out[plan_name] = (losses, state if rank == 0 else None)
    return out


def test_dropout_draws_the_same_masks_under_every_plan():
    """A checkpointed unit recomputes its forward in backward, dropout included: it must draw the masks its
    forward drew (and leave the generator where one forward leaves it), or its gradients silently differ from
    the same unit's unrecomputed. Ranks draw other masks than one process would, so plans are compared with
    each other, on the same ranks and seeds."""
    torch.manual_seed(0)
    paths = [u.path for u in osdp.discover_units(DropoutNet())]
    assert paths == [u.path for u in osdp.discover_units(build())]  # ContractNet's plans apply
    chosen = {n: p.to_json() for n, p in plans().items()}
    per_rank = run_ranks(_train_with_dropout, 2, chosen, batches(), timeout=600)
    ref_losses, ref_state = per_rank[0]["replicate"]
    failures = []
    for name, (losses, state) in per_rank[0].items():
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        if loss_err > ATOL or param_err > ATOL:
            failures.append(f"{name}: loss {loss_err:.1e}, parameters {param_err:.1e}")
    assert not failures, "dropout trained otherwise than under the replicated plan:\n" + "\n".join(failures)


# -- replicas that drift apart are found ------------------------------------------------------------------------


def _drift(rank, world_size, plan_json):
    model = build()
    osdp.wrap(model, plan=plan_json)
    osdp.check_replicas(model)
    if rank == 1:
        with torch.no_grad():
            model.head.bias.add_(1e-7)  # a DTensor replicated on the world mesh: this rank's copy only
    try:
        osdp.check_replicas(model)
    except osdp.ReplicaDivergence as e:
        return str(e)
    return None


def test_the_replicas_checksum_reads_values_whatever_the_layout_and_sees_any_change():
    from osdp.fsdp_ext.replicas import checksum

    torch.manual_seed(0)
    weight = torch.randn(16, 3, 5, 5)
    assert torch.equal(checksum(weight), checksum(weight.to(memory_format=torch.channels_last)))
    changed, swapped = weight.clone(), weight.clone()
    changed[9, 1, 2, 3] = torch.nextafter(changed[9, 1, 2, 3], torch.tensor(1e9))  # one bit
    swapped[3, 0, 0, 0], swapped[3, 0, 0, 1] = weight[3, 0, 0, 1], weight[3, 0, 0, 0]
    assert not torch.equal(checksum(weight), checksum(changed))
    assert not torch.equal(checksum(weight), checksum(swapped))
    long_row = torch.randn(3, 50_000)  # rows longer than a step
    assert torch.equal(checksum(long_row), checksum(long_row.t().contiguous().t()))
    assert checksum(torch.empty(0, 4)).tolist() == [0, 0] and checksum(torch.tensor(1.0)).tolist() != [0, 0]


def test_check_replicas_names_a_replicated_parameter_one_rank_changed():
    plan = plans()["replicate"]
    messages = run_ranks(_drift, 2, plan.to_json(), timeout=120)
    for message in messages:  # every rank raises the same error
        assert message is not None and "head.bias" in message, messages
    assert messages[0] == messages[1]


class _RenormedLookup(nn.Embedding):
    """An embedding renormalizing the rows it looks up as its forward runs (written as F.embedding's call, so
    no ``max_norm`` attribute tells): each rank renormalizes the rows of its own batch."""

    def forward(self, x):
        return F.embedding(x, self.weight, max_norm=1.0)


class _ClampedLinear(nn.Linear):
    """A Linear bounding its own weight in place as its forward begins: every rank writes the same values."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


class _WrittenInForward(nn.Module):
    def __init__(self, renormed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = (_RenormedLookup if renormed else nn.Embedding)(24, 8)
        self.body = nn.Sequential(_ClampedLinear(8, 16), nn.GELU(), _ClampedLinear(16, 8))
        self.head = nn.Linear(8, 24)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # rows beyond the renormalization's bound

    def forward(self, x, y):
        h = self.emb(x)
        return F.cross_entropy(self.head(h + self.body(h)).flatten(0, 1), y.flatten())


def _written_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 24, (8, 6), generator=g), torch.randint(0, 24, (8, 6), generator=g))
            for _ in range(STEPS)]


def _train_written(rank, world_size, renormed, plans_json):
    def run(model):
        try:
            return train(model, _written_batches(), rank, world_size)
        except osdp.ReplicaDivergence as e:
            return str(e)

    return run_under_plans(rank, lambda: _WrittenInForward(renormed), plans_json, run)


def test_parameters_a_forward_writes_from_each_ranks_batch_raise_on_every_rank_and_same_writes_train_on():
    plans = every_mode_plans(_WrittenInForward(renormed=True))
    names = list(plans)  # not checkpointed: a unit writing its parameters in its forward is refused that
    plans_json = [replace(p, units=[replace(u, checkpoint=False) for u in p.units]).to_json() for p in plans.values()]
    ranks = run_ranks(_train_written, 2, True, plans_json, timeout=240)
    for name, (out0, _), (out1, _) in zip(names, *ranks):
        assert isinstance(out0, str) and out0 == out1, (name, out0, out1)  # the same error on every rank
        assert "emb.weight" in out0 and "max_norm" in out0 and "body" not in out0, (name, out0)
    # the Linears clamping their own weights alike on every rank train as on one process
    ref = reference(lambda: _WrittenInForward(renormed=False), _written_batches())
    assert_matches_reference(run_ranks(_train_written, 2, False, plans_json, timeout=240), ref, names)


# -- what cannot be done raises on every rank, before anything diverges ---------------------------------------


def _flip_during_backward(rank, world_size):
    model = build()
    osdp.wrap(model, plan=plans()["replicate"].to_json())
    x, y = batches()[0][0]
    logits, _ = model(x[rank * 2:(rank + 1) * 2])

    def freeze(grad):  # as backward starts
        model.blocks[1].mlp.requires_grad_(False)

    logits.register_hook(freeze)
    try:
        ce(logits, y[rank * 2:(rank + 1) * 2]).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_requires_grad_changed_during_a_backward_raises_on_every_rank():
    for message in run_ranks(_flip_during_backward, 2, timeout=120):
        assert message is not None and "changed during a backward" in message, message
        assert "blocks.1.mlp" in message and "between steps" in message, message


def test_a_forward_that_uses_no_parameter_is_refused_before_the_search():
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return x.sum() * 2

    from osdp.describe.batch import ProfileError
    from osdp.describe.measure import resolve_units

    with pytest.raises(ProfileError, match="used none of the model's parameters"):
        resolve_units(Detached(), torch.randn(2, 4), None, None)


class Alternating(nn.Module):
    """Research code that keeps a step counter as a plain attribute and picks its expert by it."""

    def __init__(self, h=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(h, 32), nn.ReLU(), nn.Linear(32, h)) for _ in range(2)])
        self.head = nn.Linear(h, vocab)
        self.steps = 0

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.experts[self.steps % 2](x)
        if self.training:
            self.steps += 1
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _alternating_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(4)]


def _alternating_searched(rank, world_size):
    from training_check import train

    torch.manual_seed(0)
    model, counts = Alternating(), {}
    _count_calls(model, counts)
    mine = tuple(t.chunk(world_size)[rank] for t in _alternating_batches()[0])
    osdp.wrap(model, device_mem="1GiB", example_input=mine, loss_fn=lambda loss: loss)  # rank 0 describes it
    steps_after_wrap, calls_while_wrapping = model.steps, dict(counts)
    losses = train(model, _alternating_batches(), rank, world_size)
    state = full_state(model)  # a collective wherever the plan sharded a unit: every rank calls it
    return steps_after_wrap, calls_while_wrapping, counts, losses, state if rank == 0 else None


def _count_calls(model: nn.Module, counts: dict) -> None:
    """Hooks as logging registers them, on modules (forward, pre-forward, backward) and on a parameter (its
    gradient accumulated: where optimizer-in-backward steps)."""
    def count(key):
        return lambda *_: counts.__setitem__(key, counts.get(key, 0) + 1)

    for path in ("emb", "experts.0", "experts.1.0", "head"):
        module = model.get_submodule(path)
        module.register_forward_hook(count(f"{path}:fwd"))
        module.register_forward_pre_hook(count(f"{path}:pre"))
        module.register_full_backward_hook(count(f"{path}:bwd"))
    model.head.weight.register_post_accumulate_grad_hook(count("head.weight:grad"))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed with respect to module outputs")
def test_the_search_leaves_no_trace_in_what_the_users_code_sees():
    """The search runs the user's forward: a trace on every rank, a describe on rank 0 alone (many forwards and
    backwards). A counter it advanced there and not on rank 1 sent the ranks down different experts (rank 0
    aborted in a collective); hooks the user registered before wrapping fired for each measuring pass, on rank 0
    more than on the others. Now the counter is as the user left it, no hook fires while wrapping, and in
    training every hook fires as often as in one process."""
    from training_check import train

    torch.manual_seed(0)
    reference, reference_counts = Alternating(), {}
    _count_calls(reference, reference_counts)
    ref_losses = train(reference, _alternating_batches())
    ranks = run_ranks(_alternating_searched, 2, timeout=240)
    assert [steps for steps, *_ in ranks] == [0, 0]  # as the user left it
    for rank, (_, calls_while_wrapping, counts, _, _) in enumerate(ranks):
        assert calls_while_wrapping == {}, (rank, calls_while_wrapping)
        # the global batch in one process, each rank's half here: every hook runs as often
        assert counts == reference_counts, (rank, counts, reference_counts)
    losses = [sum(r[3][s] for r in ranks) / 2 for s in range(len(ref_losses))]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (losses, ref_losses)
    state = ranks[0][4]
    assert max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= ATOL


def _class_names(rank, world_size, plans_json):
    import warnings

    names = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", append=True)  # below the filters osdp set
            model(*[t[:2] for t in toy_batches()[0]]).backward()  # units returning views (the attention's)
        names.append(({path: type(m).__name__ for path, m in model.named_modules()}, repr(model),
                      [str(w.message) for w in seen]))
    return names


def test_class_names_and_the_repr_do_not_show_the_plan():
    """A unit's class was FSDP2's FSDP<name> (a checkpointed one's FSDPCheckpointed<name>), a module the plan did
    not make a unit kept its name: ``type(m).__name__``, ``print(model)`` and what Hugging Face's save_pretrained
    writes as the architecture changed with the plan. Every module keeps the user's class name (a split Linear
    is a ``SplitLinear``, an ``nn.Linear`` subclass). And no warning in a step: FSDP2's of a unit returning a view
    (which osdp handles) is matched by the module's name."""
    plans = every_mode_plans(build_toy())
    expected = {path: type(m).__name__ for path, m in build_toy().named_modules()}
    for rank_names in run_ranks(_class_names, 2, [p.to_json() for p in plans.values()], timeout=120):
        for plan_name, (names, text, warned) in zip(plans, rank_names):
            assert warned == [], (plan_name, warned)  # FSDP2's warning of what osdp handles, kept quiet
            split = {path for path, name in names.items() if name == "SplitLinear"}
            assert split == set() or plan_name == "split", plan_name
            assert {p: "Linear" if p in split else n for p, n in names.items()} == expected, plan_name
            assert text.replace("SplitLinear", "Linear") == repr(build_toy()), plan_name


def _dropped(rank, world_size, plan_jsons):
    """Per plan: build, wrap, train two steps, drop the model and optimizer; then whether the model, any of its
    parameters or any tensor made since is still alive."""
    import gc
    import weakref

    def live_tensors() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    def train_and_drop(plan_json) -> list[weakref.ref]:
        model = build()
        refs = [weakref.ref(model)]
        osdp.wrap(model, plan=plan_json)
        refs += [weakref.ref(p) for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for micro in batches()[:2]:
            x, y = micro[0]
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            logits, _ = model(x)
            ce(logits, y).backward()
            opt.step()
            opt.zero_grad()
        return refs

    for plan_json in plan_jsons.values():  # what is made once and kept (a device mesh of the group) is made here
        train_and_drop(plan_json)
    out = {}
    for name, plan_json in plan_jsons.items():
        before = live_tensors()
        refs = train_and_drop(plan_json)
        gc.collect()
        out[name] = {"alive": sum(r() is not None for r in refs), "new_tensors": len(live_tensors() - before)}
    return out


def test_a_dropped_model_is_freed_under_every_plan():
    """The user drops a wrapped model (a sweep, a fold of cross-validation): its memory comes back under every
    plan. Hooks that held osdp's state strongly (a replicated parameter's gradient hook holding its reducer, a
    split unit's extras in a table keyed by the unit) kept the whole model alive: on a GPU its bytes counted in
    every later model's peak."""
    plan_jsons = {name: plan.to_json() for name, plan in plans().items()}
    per_rank = run_ranks(_dropped, 2, plan_jsons, timeout=240)
    for name in plan_jsons:
        for rank, result in enumerate(per_rank):
            assert result[name] == {"alive": 0, "new_tensors": 0}, (name, rank, result[name])


HOOKED = ("blocks.0", "blocks.0.mlp", "blocks.0.mlp.0", "blocks.1.attn.0", "head")


def _hooked_training(rank=0, world_size=1, plan_jsons=None):
    """Hooks registered before wrapping, as logging and feature extraction register them: each counts its calls,
    and one (on an MLP's first Linear) scales the output it returns, which the gradients must see."""
    out = {}
    for plan_name, plan_json in (plan_jsons or {"one process": None}).items():
        model, counts = build(), {}
        for path in HOOKED:
            module = model.get_submodule(path)
            for kind, register in (("fwd", module.register_forward_hook), ("pre", module.register_forward_pre_hook),
                                   ("bwd", module.register_full_backward_hook)):
                register(lambda *_, key=f"{path}:{kind}": counts.__setitem__(key, counts.get(key, 0) + 1))
        model.get_submodule("blocks.1.mlp.0").register_forward_hook(lambda module, args, output: output * 0.5)
        if plan_json is not None:
            osdp.wrap(model, plan=plan_json)
        losses = run_behaviour(model, "plain", batches(), rank, world_size)
        out[plan_name] = (counts, losses, full_state(model) if plan_json is not None else model.state_dict())
    return out


def test_hooks_on_the_users_modules_run_as_often_under_every_plan():
    """Split Linears keep their hooks (the module is made a SplitLinear in place), and a checkpointed unit's
    recompute runs again only the hooks of its modules that changed what they returned."""
    (reference,) = _hooked_training().values()
    ranks = run_ranks(_hooked_training, 2, {k: v.to_json() for k, v in plans().items()}, timeout=300)
    for plan_name, (counts, losses, state) in ranks[0].items():
        assert counts == reference[0], (plan_name, counts, reference[0])
        averaged = [sum(r[plan_name][1][s] for r in ranks) / 2 for s in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(averaged, reference[1])) <= ATOL, plan_name
        assert max((state[k] - reference[2][k]).abs().max().item() for k in reference[2]) <= ATOL, plan_name


class VAE(nn.Module):
    """Trained through its methods, as VAEs and models with a ``training_loss`` are: the loop calls
    ``model.training_loss(x)``, or ``model.encode`` and ``model.decode`` itself, never ``forward``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.dec = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16))
        self.scale = nn.Parameter(torch.ones(1))

    def encode(self, x):
        h = self.enc(x)
        return h[:, :4], h[:, 4:]

    def decode(self, z):
        return self.dec(z) * self.scale

    def forward(self, x):
        mu, log_var = self.encode(x)
        return self.decode(mu), mu, log_var

    def training_loss(self, x):
        mu, log_var = self.encode(x)
        return _vae_loss(self.decode(mu), x, mu, log_var)


def _vae_loss(reconstruction, x, mu, log_var):
    return F.mse_loss(reconstruction, x) - 0.5 * (1 + log_var - mu ** 2 - log_var.exp()).mean()


METHODS = {"training_loss": ("training_loss",), "encode and decode": ("encode", "decode")}


def _vae_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _train_through_methods(model, how, rank=0, world_size=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x in _vae_batches():
        x = x.chunk(world_size)[rank]
        if how == "training_loss":
            loss = model.training_loss(x)
        else:
            mu, log_var = model.encode(x)
            loss = _vae_loss(model.decode(mu), x, mu, log_var)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if world_size > 1:
            osdp.check_replicas(model)


def _vae_built():
    torch.manual_seed(0)
    return VAE()


def _vae_under_plans(rank, world_size, how):
    from torch.distributed.fsdp import register_fsdp_forward_method
    from training_check import plan_kinds

    out = {}
    wraps = {name: dict(plan=p.to_json()) for name, p in plan_kinds(_vae_built()).items()}
    wraps["searched"] = dict(device_mem="1GiB", example_input=_vae_batches()[0].chunk(world_size)[rank],
                             loss_fn=lambda out: _vae_loss(out[0], out[0].detach(), *out[1:]))
    for name, how_to_wrap in wraps.items():
        model = _vae_built()
        osdp.wrap(model, **how_to_wrap)
        for method in METHODS[how]:
            register_fsdp_forward_method(model, method)  # as for fully_shard
        _train_through_methods(model, how, rank, world_size)
        state = full_state(model)  # collective
        out[name] = state if rank == 0 else None
    return out


@pytest.mark.parametrize("how", list(METHODS))
def test_a_loop_calling_methods_registered_with_fsdp2_trains_as_one_process_under_every_plan(how):
    """``register_fsdp_forward_method(model, name)``, as for a ``fully_shard``-ed model: FSDP2 runs its hooks
    around the method, and osdp's with them (replicated units computed with their DTensor views at rest, and
    their reducer never reduced, under the plans replicating any)."""
    reference = _vae_built()
    _train_through_methods(reference, how)
    expected = reference.state_dict()
    for name, state in run_ranks(_vae_under_plans, 2, how, timeout=300)[0].items():
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= ATOL, name


def _train_with_an_optimizer_built_first(model, wrap, steps_before, rank=0, world_size=1):
    """AdamW built from the model's parameters before wrapping (``wrap`` None: one process, not wrapped),
    ``steps_before`` steps taken before wrapping, the rest after. The list of parameters it was given is
    returned (a loop that keeps it keeps the parameters the plan replaced)."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    for i, x in enumerate(_vae_batches()):
        if i == steps_before and wrap is not None:
            osdp.wrap(model, **wrap)
        x = x.chunk(world_size)[rank] if i >= steps_before else x  # before wrapping, each rank the whole batch
        reconstruction, mu, log_var = model(x)
        _vae_loss(reconstruction, x, mu, log_var).backward()
        opt.step()
        opt.zero_grad()
    return params


def _optimizer_built_first_under_plans(rank, world_size, steps_before):
    from training_check import plan_kinds

    wraps = {name: dict(plan=p.to_json()) for name, p in plan_kinds(_vae_built()).items()}
    wraps["searched"] = dict(device_mem="1GiB", example_input=_vae_batches()[0].chunk(world_size)[rank],
                             loss_fn=lambda out: _vae_loss(out[0], out[0].detach(), *out[1:]))
    out, alive = {}, []  # the earlier wraps' parameters still held, as in a process training one model after another
    for name, how_to_wrap in wraps.items():
        model = _vae_built()
        alive.append(_train_with_an_optimizer_built_first(model, how_to_wrap, steps_before, rank, world_size))
        state = full_state(model)  # collective
        out[name] = state if rank == 0 else None
    return out


@pytest.mark.parametrize("steps_before", [0, 1])
def test_an_optimizer_built_before_wrapping_trains_as_one_process_under_every_plan(steps_before):
    """``opt = AdamW(model.parameters())`` and then ``osdp.wrap(model, ...)``: FSDP2 puts new parameters in the
    sharded units' place, so that optimizer stepped only the replicated units' (all of them under ``ddp``, none
    under ``fsdp``), silently. Now it steps the ones in their place under every plan; one stepped before
    wrapping keeps its state, laid out as the parameters are."""
    reference = _vae_built()
    _train_with_an_optimizer_built_first(reference, None, steps_before)
    expected = reference.state_dict()
    for name, state in run_ranks(_optimizer_built_first_under_plans, 2, steps_before, timeout=300)[0].items():
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= ATOL, name
