"""A catalogue of bad (or merely unusual) inputs: each either works like one process would, or fails
with the exact message below on every rank, before any rank is left waiting in a collective."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from dist_harness import run_ranks
from toy_models import GPT
from training_check import full_state

import osdp
from osdp.describe.units import structure_signature
from osdp.schema.plan import Plan, PlanError, UnitPlan

SIZE_HELP = ("examples: 16GiB, '16 GiB', 1.5GB, 512MiB, 2048 (bytes); units are case-insensitive: "
             "kB MB GB TB (powers of 1000), KiB MiB GiB TiB (powers of 1024)")


# -- models --------------------------------------------------------------------------------


class Uneven(nn.Module):
    """No dimension divides by 2 or 4; ``out`` has 3 rows, so on 4 ranks one rank holds none of it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 67)
        self.mid = nn.Sequential(nn.Linear(67, 65), nn.Tanh())  # 65 x 67 weight: large enough to split
        self.out = nn.Linear(65, 3)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.mid(torch.tanh(self.inp(x)))), y)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # never called: no gradient, ever

    def forward(self, x):
        return torch.relu(self.used(x))


class Branchy(nn.Module):
    """Unit ``b`` runs only when asked; unit ``pair`` always holds a parameter that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.pair = Pair()
        self.head = nn.Linear(8, 2)

    def forward(self, x, y, use_b=False):
        h = self.a(x)
        if use_b:
            h = self.b(h)
        return F.mse_loss(self.head(self.pair(h)), y)


class TupleOut(nn.Module):
    """Returns (prediction, hidden) or {"out": ..., "hidden": ...}: the user computes the loss."""

    def __init__(self, kind="tuple"):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = self.b(h)
        return (out, h) if self.kind == "tuple" else {"out": out, "hidden": h}


class FunctionalSparse(nn.Module):
    """A table kept as a bare Parameter, looked up with ``F.embedding(..., sparse=True)``: no nn.Embedding says so."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, idx):
        return self.out(F.embedding(idx, self.table, sparse=True)).sum()


def _seeded(cls, *args, **kw):
    torch.manual_seed(0)
    return cls(*args, **kw)


def _frozen_gpt():
    model = _seeded(GPT)
    for name, p in model.named_parameters():
        # a whole unit, one weight inside a unit that is split, and a unit of its own
        if name.startswith("blocks.0.attn.") or name in ("blocks.1.mlp.fc.weight", "wpe.weight"):
            p.requires_grad_(False)
    return model


def _frozen_plan():
    def unit(path):
        if path.endswith("mlp"):
            return UnitPlan(path, "zero3", split=2)
        return UnitPlan(path, "replicate" if path.endswith("attn") else "zero2")
    return Plan([unit(u.path) for u in osdp.discover_units(GPT())])


def _paths(model):
    return [u.path for u in osdp.discover_units(model)]


def _split_plan(model, k):
    return Plan([UnitPlan(p, "zero3", split=k) if p == "mid" else UnitPlan(p, "zero2", checkpoint=p == "inp")
                 for p in _paths(model)])


def _mixed_plan(model):
    return Plan([UnitPlan(p, ("zero3", "zero2", "replicate")[i % 3], checkpoint=i % 2 == 1)
                 for i, p in enumerate(_paths(model))])


# -- training like one process -------------------------------------------------------------


def _batches(n_in, n_out, steps=3, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, n_in, generator=g), torch.randn(rows, n_out, generator=g)) for _ in range(steps)]


def _gpt_batches(steps=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (rows, 16), generator=g),) * 2 for _ in range(steps)]


def _train(model, batches, rank=0, world_size=1, loss_of=None, kwargs_per_step=None):
    """SGD with momentum on this rank's slice of each global batch; returns this rank's losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i, batch in enumerate(batches):
        n = batch[0].shape[0] // world_size
        mine = [t[rank * n:(rank + 1) * n] for t in batch]
        kwargs = kwargs_per_step[i] if kwargs_per_step else {}
        loss = loss_of(model, *mine) if loss_of else model(*mine, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tuple_loss(model, x, y):
    return F.mse_loss(model(x)[0], y)


def _dict_loss(model, x, y):
    return F.mse_loss(model(x)["out"], y)


BRANCH_STEPS = [{}, {}, {"use_b": True}, {}]  # unit b sits out steps 0, 1 and 3


def _cases(world_size):
    """name -> (build, plan or strategy, batches, loss_of, kwargs per step): each must train like one process."""
    cases = {
        "frozen": (_frozen_gpt, _frozen_plan(), _gpt_batches(), None, None),
        "frozen_fsdp": (_frozen_gpt, "fsdp", _gpt_batches(), None, None),
        "tuple_output": (lambda: _seeded(TupleOut), "zero2", _batches(8, 2), _tuple_loss, None),
        "dict_output": (lambda: _seeded(TupleOut, "dict"), _mixed_plan(TupleOut()), _batches(8, 2), _dict_loss, None),
    }
    for strategy in ("ddp", "zero2", "fsdp"):
        cases[f"uneven_{strategy}"] = (lambda: _seeded(Uneven), strategy, _batches(7, 3), None, None)
        cases[f"unused_{strategy}"] = (lambda: _seeded(Branchy), strategy, _batches(8, 2, 4), None, BRANCH_STEPS)
    cases["uneven_split"] = (lambda: _seeded(Uneven), _split_plan(Uneven(), world_size), _batches(7, 3), None, None)
    cases["unused_mixed"] = (lambda: _seeded(Branchy), _mixed_plan(Branchy()), _batches(8, 2, 4), None, BRANCH_STEPS)
    return cases


def _train_cases(rank, world_size, names):
    out = {}
    for name, (build, how, batches, loss_of, kwargs) in _cases(world_size).items():
        if name not in names:
            continue
        model = build()
        # a unit sitting out a step leaves replicated parameters without gradients: no setting needed
        if isinstance(how, str):
            osdp.wrap(model, strategy=how)
        else:
            osdp.wrap(model, plan=how)
        losses = _train(model, batches, rank, world_size, loss_of, kwargs)
        state = full_state(model)
        out[name] = (losses, state if rank == 0 else None)
    return out


def _assert_like_one_process(per_rank, world_size, names, atol=1e-5):
    cases = _cases(world_size)
    for name in names:
        build, _, batches, loss_of, kwargs = cases[name]
        model = build()
        ref_losses = _train(model, batches, loss_of=loss_of, kwargs_per_step=kwargs)
        ref_state = model.state_dict()
        losses = [sum(r[name][0][i] for r in per_rank) / world_size for i in range(len(batches))]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= atol, (name, losses, ref_losses)
        state = per_rank[0][name][1]
        assert set(state) == set(ref_state), name
        err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert err <= atol, f"{name} on {world_size} ranks: parameters differ from one process by {err:.2e}"


# -- errors --------------------------------------------------------------------------------


def _message(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the catalogue records what each input gets
        return type(e).__name__, str(e), getattr(e, "min_peak_bytes", None), getattr(e, "batch_size", None)
    return None


def _first_step_of(style, rank, world_size, **how):
    """Wrap a model of ``model_styles`` as ``how`` says and train one step on this rank's rows."""
    import model_styles as styles

    model = styles.build(style)
    osdp.wrap(model, **how)
    batch = styles.batches(style, 2 * world_size, 1)[0]
    mine = tuple(t.chunk(world_size)[rank] for t in batch)
    styles.loss_of(style, styles.call(model, styles.inputs_of(style, mine)), mine, 0).backward()
    return model


def _critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def _gradient_penalty_step(critic, rank=0, world_size=1):
    """WGAN-GP's critic step: the penalty on the gradient with respect to the inputs, through create_graph."""
    g = torch.Generator().manual_seed(0)
    real, fake = (torch.randn(4, 16, generator=g).chunk(world_size)[rank] for _ in range(2))
    between = (0.3 * real + 0.7 * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    loss = critic(fake).mean() - critic(real).mean() + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
    loss.backward()
    return critic


def _regularised_step(model, rank=0, world_size=1):
    """A loss adding an L2 term over every parameter, read between forward and backward, as tutorials write it."""
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)).chunk(world_size)[rank]
    loss = model(x, x) + 1e-2 * sum(p.square().sum() for p in model.parameters())
    loss.backward()
    return model


def _errors_on_every_rank(rank, world_size):
    x = torch.randint(0, 64, (4, 16))
    def half_meta():
        model = _seeded(Uneven)
        model.mid.to("meta")
        return model

    paths = _paths(GPT())
    other = Plan.for_strategy(paths, "fsdp", model_signature=structure_signature(GPT()))
    return {
        "budget": _message(lambda: osdp.wrap(_seeded(GPT), device_mem="1KiB", example_input=(x, x))),
        **{f"size {s}": _message(lambda s=s: osdp.wrap(GPT(), device_mem=s, example_input=(x, x)))
           for s in ("sixteen", "-1GiB", "16 GB GB")},
        "mismatch": _message(lambda: osdp.wrap(GPT(), strategy="fsdp" if rank == 0 else "zero2")),
        "other_model": _message(lambda: osdp.wrap(GPT(h=48), plan=other)),
        "empty": _message(lambda: osdp.wrap(nn.Sequential(nn.ReLU(), nn.Dropout()), strategy="fsdp")),
        "empty_budget": _message(lambda: osdp.wrap(nn.Sequential(nn.ReLU()), device_mem="1GiB", example_input=x)),
        "half_meta_budget": _message(lambda: osdp.wrap(half_meta(), device_mem="1GiB",
                                                       example_input=(torch.randn(4, 7), torch.randn(4, 3)))),
        "half_meta": _message(lambda: osdp.wrap(half_meta(), strategy="ddp")),
        "meta_on_one_rank": _message(lambda: osdp.wrap(half_meta() if rank == 1 else _seeded(Uneven), strategy="fsdp")),
        "unsplittable": _message(lambda: osdp.wrap(_seeded(Uneven), plan=Plan([UnitPlan("out", "zero3", split=2)]))),
        "sparse": _message(lambda: osdp.wrap(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)),
                                             strategy="ddp")),
        "sparse_budget": _message(lambda: osdp.wrap(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)),
                                                    device_mem="1GiB", example_input=torch.zeros(4, 3, dtype=torch.long))),
        "functional_sparse_budget": _message(lambda: osdp.wrap(_seeded(FunctionalSparse), device_mem="1GiB",
                                                               example_input=torch.zeros(4, 3, dtype=torch.long))),
        "functional_sparse_ddp": _message(lambda: osdp.wrap(_seeded(FunctionalSparse), strategy="ddp")(
            torch.zeros(4, 3, dtype=torch.long)).backward()),
        "lazy": _message(lambda: osdp.wrap(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2)), strategy="fsdp")),
        "lazy_budget": _message(lambda: osdp.wrap(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2)), device_mem="1GiB",
                                                  example_input=torch.randn(4, 3))),
        "max_norm": _message(lambda: osdp.wrap(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)),
                                               device_mem="1GiB", example_input=torch.zeros(4, 3, dtype=torch.long))),
        "scripted": _message(lambda: osdp.wrap(nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh())),
                                                             nn.Linear(4, 2)), device_mem="1GiB",
                                               example_input=torch.randn(4, 4))),
        "scripted_plan": _message(lambda: osdp.wrap(torch.jit.script(nn.Sequential(nn.Linear(4, 4))), strategy="ddp")),
        "no_loss_fn": _message(lambda: osdp.wrap(TupleOut(), device_mem="1GiB", example_input=torch.randn(4, 8),
                                                 planning_device="cpu-loopback")),
        "ddp": _message(lambda: osdp.wrap(nn.parallel.DistributedDataParallel(_seeded(Uneven)), strategy="fsdp")),
        "inner_ddp": _message(lambda: osdp.wrap(nn.Sequential(nn.parallel.DistributedDataParallel(nn.Linear(7, 7)),
                                                              nn.Linear(7, 3)), device_mem="1GiB",
                                                example_input=torch.randn(4, 7))),
        "fully_shard": _message(lambda: osdp.wrap(fully_shard(_seeded(Uneven)), strategy="ddp")),
        "osdp_twice": _message(lambda: osdp.wrap(osdp.wrap(_seeded(Uneven), strategy="zero2"), strategy="fsdp")),
        # a baseline without the example that would have shown what its forward does across modules
        "tied_head": _message(lambda: _first_step_of("lambda_gpt", rank, world_size, strategy="fsdp")),
        "written_input": _message(lambda: _first_step_of("inplace", rank, world_size, strategy="zero2")),
        "double_backward": _message(lambda: _gradient_penalty_step(osdp.wrap(_critic(), strategy="fsdp"), rank,
                                                                   world_size)),
        "regularised_sharded": _message(lambda: _regularised_step(osdp.wrap(_seeded(GPT), plan=_mixed_plan(GPT())),
                                                                  rank, world_size)),
        "regularised_replicated": [p.grad.full_tensor().clone() for p in _regularised_step(
            osdp.wrap(_seeded(GPT), strategy="ddp"), rank, world_size).parameters()],
        # what the message says works: the same step replicated, its gradients then averaged over the ranks
        "double_backward_replicated": [p.grad.full_tensor().clone() for p in _gradient_penalty_step(
            osdp.wrap(_critic(), strategy="ddp"), rank, world_size).parameters()],
    }


def _plans_with_loss_fn(rank, world_size):
    """Describe and plan a model whose forward returns a tuple / a dict, given loss_fn; then train it."""
    out = {}
    for kind, pick in (("tuple", lambda o: o[0]), ("dict", lambda o: o["out"])):
        model = _seeded(TupleOut, kind)
        osdp.wrap(model, device_mem="1GiB", example_input=torch.randn(4, 8), planning_device="cpu-loopback",
                  loss_fn=lambda o, pick=pick: pick(o).square().mean())
        loss = pick(model(torch.randn(4, 8))).square().mean()
        loss.backward()
        out[kind] = (osdp.plan_of(model).hash, osdp.plan_of(model).units[0].mode, loss.item() > 0)
    return out


def _on_2(rank, world_size):
    return _errors_on_every_rank(rank, world_size), _plans_with_loss_fn(rank, world_size), \
        _train_cases(rank, world_size, set(_cases(world_size)))


UNEVEN = ["uneven_ddp", "uneven_zero2", "uneven_fsdp", "uneven_split"]


def _on_4(rank, world_size):
    return _train_cases(rank, world_size, UNEVEN)


@pytest.fixture(scope="module")
def on_2():
    return run_ranks(_on_2, 2, timeout=300)


def test_budget_below_the_minimum_names_the_minimum_and_the_batch_size(on_2):
    for errors, _, _ in on_2:
        kind, text, minimum, batch_size = errors["budget"]
        assert kind == "BudgetTooSmall" and batch_size == 4 and minimum > 1024
        assert re.fullmatch(
            r"memory budget 1\.00 KiB \(1024 bytes\) is too small: the smallest plan needs a peak of "
            rf"[\d.]+ [KM]iB \({minimum} bytes\) \(at micro-batch 4\)", text), text
    assert on_2[0][0]["budget"] == on_2[1][0]["budget"]  # the same search result on every rank


def test_junk_sizes_are_refused_with_examples(on_2):
    expected = {
        "sixteen": "invalid memory size 'sixteen': expected a number followed by an optional unit; ",
        "-1GiB": "invalid memory size '-1GiB': a memory size must be positive; ",
        "16 GB GB": "invalid memory size '16 GB GB': expected a number followed by an optional unit; ",
    }
    for size, start in expected.items():
        with pytest.raises(ValueError) as e:
            osdp.parse_size(size)
        assert str(e.value) == start + SIZE_HELP
        for errors, _, _ in on_2:  # through osdp.wrap, on every rank, before any collective
            assert errors[f"size {size}"][:2] == ("ValueError", start + SIZE_HELP)
    with pytest.raises(ValueError, match=r"^invalid memory size '16G': unit 'G' is ambiguous, write 16GB or 16GiB; "):
        osdp.parse_size("16G")
    with pytest.raises(ValueError, match=r"^invalid memory size 1\.5: a plain number is a count of bytes and must be whole"):
        osdp.parse_size(1.5)


def test_a_forward_crossing_units_as_a_plan_given_without_an_example_cannot_carry_says_what_would_work(on_2):
    """A head tied by ``F.linear(x, self.wte.weight)`` and a residual written in place into a block's output fail
    under FSDP2 with errors about DTensor and custom Functions; every rank raises the same error naming the
    module, what it did and the wraps that plan it (the same baselines given the example train it: the model
    styles' tests)."""
    for name, did in (("tied_head", r"LambdaGPT's forward used a parameter that this plan holds sharded there"),
                      ("written_input", r"forward wrote in place to the input or output of a unit")):
        kinds_and_texts = {errors[name][:2] for errors, _, _ in on_2}
        assert len(kinds_and_texts) == 1, kinds_and_texts  # alike on every rank
        ((kind, text),) = kinds_and_texts
        assert kind == "UnitBoundaryError" and re.search(did, text), text
        assert "osdp.wrap(model, strategy=..., example_input=batch)" in text, text


def test_a_backward_building_a_graph_through_units_fsdp2_holds_says_to_replicate_them(on_2):
    """WGAN-GP's gradient penalty: ``autograd.grad(..., create_graph=True)`` through units FSDP2 holds freed their
    parameters before the created graph's backward (an error about a storage of size 0), or, kept, lost its
    gradients; every rank now raises the same error naming the unit and what works, which trains as one process."""
    kinds_and_texts = {errors["double_backward"][:2] for errors, _, _ in on_2}
    assert len(kinds_and_texts) == 1, kinds_and_texts
    ((kind, text),) = kinds_and_texts
    assert kind == "UnitBoundaryError" and "a backward with create_graph=True" in text, text
    assert re.search(r"went through unit '(1|2|<root>)'", text) and "mode 'replicate'" in text, text
    reference = [p.grad for p in _gradient_penalty_step(_critic()).parameters()]
    for errors, _, _ in on_2:
        replicated = errors["double_backward_replicated"]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(replicated, reference))


def test_a_loss_mixing_sharded_parameters_into_the_output_says_where_to_compute_it(on_2):
    """An L2 term over ``model.parameters()`` between forward and backward: replicated (and zero2) units show
    their parameters whole there and train as one process; units freed after forward show DTensor shards, whose
    gradients failed deep in backward (a bare AssertionError, or an FSDP2 op without a sharding strategy);
    every rank now raises one error saying where to compute the term, as the backward begins."""
    kinds_and_texts = {errors["regularised_sharded"][:2] for errors, _, _ in on_2}
    assert len(kinds_and_texts) == 1, kinds_and_texts
    ((kind, text),) = kinds_and_texts
    assert kind == "UnitBoundaryError" and "the loss combined the model's output with DTensors" in text, text
    assert "in the model's forward" in text and "weight_decay" in text, text
    reference = [p.grad for p in _regularised_step(_seeded(GPT)).parameters()]
    for errors, _, _ in on_2:
        replicated = errors["regularised_replicated"]
        assert len(replicated) == len(reference)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(replicated, reference))


def test_the_forward_of_a_wrapped_model_keeps_its_signature():
    """Hugging Face's Trainer keeps the batch's columns that ``inspect.signature(model.forward)`` names."""
    import inspect

    import model_styles as styles

    model = styles.build("padded")
    before = inspect.signature(model.forward)
    osdp.wrap(model, strategy="fsdp")
    try:
        assert inspect.signature(model.forward) == before and "mask" in before.parameters
    finally:
        dist.destroy_process_group()


def test_mismatched_plans_and_plans_for_another_model_fail_on_every_rank(on_2):
    paths = _paths(GPT())
    fsdp, zero2 = (osdp.strategy_plan(GPT(), s) for s in ("fsdp", "zero2"))
    assert fsdp.paths == paths
    for errors, _, _ in on_2:
        assert errors["mismatch"][:2] == ("PlanError", (
            f"ranks hold different plans (ranks [0] hold plan {fsdp.hash}; ranks [1] hold plan {zero2.hash}); "
            "every rank must apply the same plan (load the same JSON, or let osdp search once and broadcast)"))
        assert errors["other_model"][:2] == ("PlanError", (
            f"the plan was made for a different model (structure signature {structure_signature(GPT())} vs this "
            f"model's {structure_signature(GPT(h=48))}); re-plan for this model"))
        assert errors["unsplittable"][:2] == ("PlanError", (
            "unit 'out' cannot be split (split=2): it holds no Linear large enough to split that is not tied to "
            "another module; use split=1"))


def test_models_without_parameters_partly_materialized_renormalizing_rows_or_already_distributed_are_refused(on_2):
    # a model wholly on the meta device is wrapped (tests/fsdp_ext/test_meta_init.py); partly, it is refused
    half = ("PlanError", "the model is partly materialized: 2 of its 6 parameters and buffers are on the meta device "
                         "(mid.0.weight, mid.0.bias); build it all on the meta device (then osdp.wrap, "
                         "model.to_empty(device=...) and your initialisation) or all on a real device")
    empty = ("PlanError", "the model has no parameters: there is nothing to shard or replicate")
    for rank, (errors, _, _) in enumerate(on_2):
        assert errors["empty"][:2] == empty and errors["empty_budget"][:2] == empty
        assert errors["half_meta"][:2] == half and errors["half_meta_budget"][:2] == half
        sparse = ("PlanError", "0.weight: sparse gradients (an embedding looked up with sparse=True), which FSDP2 "
                               "cannot reduce-scatter and osdp does not all-reduce; look it up with sparse=False "
                               "(dense gradients), or freeze it")
        assert errors["sparse"][:2] == sparse and errors["sparse_budget"][:2] == sparse
        # looked up by F.embedding: found by the search's backward of the example, or the reducer's first gradient
        functional = sparse[1].replace("0.weight", "table")
        assert errors["functional_sparse_budget"][1] == functional, errors["functional_sparse_budget"]
        assert errors["functional_sparse_ddp"][:2] == ("RuntimeError", functional), errors["functional_sparse_ddp"]
        lazy = ("PlanError", "the model has lazy modules not yet initialized (0.weight, 0.bias): their shapes are "
                             "known only after a forward; call the model once on a batch (model(example)) before "
                             "osdp.wrap")
        assert errors["lazy"][:2] == lazy and errors["lazy_budget"][:2] == lazy
        assert errors["max_norm"][0] == "PlanError" and errors["max_norm"][1].startswith(
            "0: an embedding with max_norm renormalizes in place"), errors["max_norm"]
        # FSDP2 can neither hook nor shard a TorchScript module: named (the outermost only), before anything runs
        assert errors["scripted"][:2] == ("PlanError", "0: TorchScript modules (torch.jit.script or torch.jit.trace "
                                          "of a module), which FSDP2 can neither hook nor shard (PyTorch: "
                                          "register_forward_pre_hook is not supported on ScriptModules); keep them as "
                                          "Python modules (functions the forward calls may stay scripted), and "
                                          "compile with torch.compile instead"), errors["scripted"]
        assert errors["scripted_plan"][1].startswith("<root>: TorchScript modules"), errors["scripted_plan"]
        for name, where, what in (("ddp", "the model", "DistributedDataParallel"),
                                  ("inner_ddp", "its module '0'", "DistributedDataParallel"),
                                  ("fully_shard", "the model", "fully_shard")):
            assert errors[name][:2] == ("PlanError", (
                f"{where} is already distributed by {what}: osdp replicates and shards the model itself, and two "
                "of them would reduce the same gradients; pass the model as built, before DistributedDataParallel "
                "or fully_shard (a DistributedDataParallel's model.module)")), errors[name]
        assert errors["osdp_twice"][:2] == ("PlanError", "this model is already wrapped by osdp; wrap a fresh model "
                                                         "(osdp.plan_of(model) shows its plan)")
    # only rank 1's model is on the meta device: rank 0 is told, not left waiting
    assert on_2[1][0]["meta_on_one_rank"][:2] == half
    assert on_2[0][0]["meta_on_one_rank"][:2] == ("PlanError", f"rank(s) [1] failed: PlanError: {half[1]}")


@pytest.mark.gpu  # a model on two devices needs a second one
def test_a_model_on_two_devices_or_on_another_device_is_refused():
    spread = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).cuda())
    try:
        with pytest.raises(PlanError, match=r"^the model's parameters and buffers are on several devices \(cpu: "
                                            r"0\.weight, 0\.bias; cuda:0: 1\.weight, 1\.bias\); move the whole model"):
            osdp.wrap(spread, strategy="fsdp", device="cpu")
        with pytest.raises(PlanError, match=r"^the model is on cuda:0 but osdp.wrap would run it on cpu; pass "
                                            r"device='cuda:0'"):
            osdp.wrap(nn.Sequential(nn.Linear(4, 4)).cuda(), strategy="fsdp", device="cpu")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_outputs_that_are_tuples_or_dicts_train_and_plan_with_a_loss_fn(on_2):
    for errors, plans, _ in on_2:
        assert errors["no_loss_fn"][:2] == ("ProfileError", "the model's output is not a scalar loss; pass "
                                            "loss_fn=... (called on the output, returning a scalar tensor)")
        assert plans["tuple"][2] and plans["dict"][2]
    assert on_2[0][1] == on_2[1][1]  # the same plans everywhere
    _assert_like_one_process([r[2] for r in on_2], 2, ["tuple_output", "dict_output"])


def test_frozen_parameters_train_like_one_process(on_2):
    _assert_like_one_process([r[2] for r in on_2], 2, ["frozen", "frozen_fsdp"])
    frozen = on_2[0][2]["frozen"][1]
    assert torch.equal(frozen["wpe.weight"], _frozen_gpt().wpe.weight)  # never moved


def _backward_leaving_parameters_unused(rank, world_size, how):
    model = _seeded(Branchy)
    osdp.wrap(model, **how)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(8, 2, 1)[0]
    model(x, y).backward()
    optimizer.step()
    osdp.check_replicas(model)
    return {k: v.detach().clone() for k, v in full_state(model).items()}


def test_a_backward_leaving_replicated_parameters_unused_trains_as_one_process():
    """A step that leaves replicated parameters without a gradient (a branch not taken) needs no setting: as
    under FSDP2, they keep no gradient and the others are reduced (osdp 0.x raised UnusedParametersError)."""
    reference = _seeded(Branchy)
    x, y = _batches(8, 2, 1)[0]
    reference(x, y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    beside_sharded = Plan([UnitPlan("a", "zero3"), UnitPlan("b", "zero2"), UnitPlan("pair", "replicate"),
                           UnitPlan("head", "zero3", checkpoint=True)])
    for how in (dict(strategy="ddp"), dict(plan=beside_sharded.to_json())):
        state = run_ranks(_backward_leaving_parameters_unused, 2, how, timeout=60)[0]
        for k, v in reference.state_dict().items():
            assert torch.allclose(state[k], v, atol=1e-6), (how, k)


def test_unused_parameters_and_branches_not_taken_train_like_one_process(on_2):
    _assert_like_one_process([r[2] for r in on_2], 2, ["unused_ddp", "unused_zero2", "unused_fsdp", "unused_mixed"])
    state = on_2[0][2]["unused_fsdp"][1]
    assert torch.equal(state["pair.unused.weight"], _seeded(Branchy).pair.unused.weight)


def test_uneven_shapes_train_like_one_process_on_2_and_4_ranks(on_2):
    _assert_like_one_process([r[2] for r in on_2], 2, UNEVEN)
    _assert_like_one_process(run_ranks(_on_4, 4, timeout=240), 4, UNEVEN)


def test_world_size_1_trains_like_plain_pytorch():
    batches = _batches(7, 3)
    ref = _seeded(Uneven)
    ref_losses = _train(ref, batches)
    model = osdp.wrap(_seeded(Uneven), plan=_split_plan(Uneven(), 2))
    try:
        assert dist.get_world_size() == 1
        assert _train(model, batches) == pytest.approx(ref_losses, abs=1e-6)
        state = model.state_dict()
        assert max((state[k].full_tensor() - v).abs().max().item() for k, v in ref.state_dict().items()) <= 1e-6
    finally:
        dist.destroy_process_group()


def test_arguments_that_make_no_sense_are_refused_before_any_collective(capsys):
    with pytest.raises(ValueError, match=r"^osdp.wrap needs exactly one of device_mem=... \(with example_input=...\), "
                                         r"plan=... or strategy=... \(ddp, fsdp, zero2, zero3\); got none$"):
        osdp.wrap(GPT())
    with pytest.raises(ValueError, match=r"^osdp.wrap\(device_mem=...\) needs example_input=..."):
        osdp.wrap(GPT(), device_mem="1GiB")
    with pytest.raises(PlanError, match=r"^unknown strategy 'fsdp2'; use one of ddp, fsdp, zero2, zero3$"):
        osdp.wrap(GPT(), strategy="fsdp2")
    with pytest.raises(PlanError, match=r"^unit 'blocks.0.mlp': split=2 needs mode 'zero3'"):
        UnitPlan("blocks.0.mlp", "zero2", split=2)
    text = Plan([UnitPlan("blocks.0.mlp")]).to_json().replace('"zero3"', '"replicate"')
    with pytest.raises(PlanError, match=r"does not match its contents .* the JSON was edited by hand"):
        Plan.from_json(text)

    from osdp.cli.train import main

    for argv, message in ((["--checkpoint-every", "0", "--checkpoint-dir", "x"], "--checkpoint-every must be >= 1"),
                          (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("style, unit, cls", [("shared_module", "enc.1", "DecayedBlock"),
                                              ("data_ema", "block", "DataDecayedBlock")])  # through .data
def test_a_plan_checkpointing_a_unit_whose_forward_writes_its_weights_is_refused_at_that_forward(style, unit, cls):
    """A recompute would start from the weights the forward wrote: refused (every rank runs the same forward and
    raises alike), where the same plan without the checkpoint trains as one process. A write through ``.data``
    bumps no version: the unit's first training forwards compare the weights' values too."""
    import model_styles as styles

    batch = styles.batches(style, 4, 1)[0]
    units = [u.path for u in osdp.discover_units(styles.build(style))]
    for checkpoint in (True, "selective"):
        model = styles.build(style)
        osdp.wrap(model, plan=Plan([UnitPlan(p, "zero3", checkpoint=checkpoint and p == unit) for p in units]))
        try:
            with pytest.raises(RuntimeError, match=rf"^{cls}'s forward writes its parameter\(s\) fc1.weight in place"):
                styles.call(model, styles.inputs_of(style, batch)).backward()
        finally:
            dist.destroy_process_group()
    reference, model = styles.build(style), styles.build(style)
    osdp.wrap(model, plan=Plan([UnitPlan(p, "zero3") for p in units]))
    try:
        for m in (reference, model):
            styles.call(m, styles.inputs_of(style, batch)).backward()
        assert all(torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters()))
    finally:
        dist.destroy_process_group()


class _HeadMadeInForward(nn.Module):
    """A head sized from the first batch, made in the forward (as Keras builds layers)."""

    def __init__(self, h=16):
        super().__init__()
        self.emb = nn.Embedding(32, h)
        self.body = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.head = None

    def forward(self, x, y):
        h = self.body(self.emb(x))
        if self.head is None:
            self.head = nn.Linear(h.shape[-1], 32)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_parameters_a_forward_makes_after_wrapping_are_refused_and_an_example_makes_them_before():
    """No unit would hold them: each rank would train its own copy on its data, silently. A plan given without an
    example is refused at the first forward; with an example the search's forward makes them, and the model
    trains as one process."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)
    torch.manual_seed(0)
    model = _HeadMadeInForward()
    osdp.wrap(model, plan=Plan([UnitPlan(u.path, "zero3") for u in osdp.discover_units(model)]))
    try:
        with pytest.raises(RuntimeError, match=r"made parameter\(s\) head.weight, head.bias in its forward"):
            model(x, y)
    finally:
        dist.destroy_process_group()
    model = _HeadMadeInForward()
    osdp.wrap(model, device_mem="1GiB", example_input=(x, y))
    try:
        reference = _HeadMadeInForward()
        reference(x, y)  # makes its head, then starts from the wrapped model's values
        reference.load_state_dict(full_state(model))
        for m in (reference, model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(x, y).backward()
            opt.step()
        state = full_state(model)
        assert set(state) == set(reference.state_dict())
        for name, ref in reference.state_dict().items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    finally:
        dist.destroy_process_group()
