"""The training-loop features people use, on a wrapped model, each against one process.

Gradient accumulation with split weights (one reduction per window, counted), gradient clipping across
units that live on different meshes and tensor kinds, AdamW's fused and foreach implementations, SAM and
L-BFGS, two backwards through one retained graph, ``torch.func.functional_call``, anomaly detection, steps after
an exception, evaluation after training, CPU autocast, and bf16 parameters with fp32 reduction.
"""

from __future__ import annotations

import copy
import io
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from cases import build_toy, every_mode_plans, toy_batches
from dist_harness import run_ranks
from training_check import (assert_matches_reference, cloned, full_state, reference, run_under_plans, sgd, train,
                            train_under_plans)

import osdp
from osdp.distributed import collectives as comm
from osdp.schema.plan import Plan
from osdp.split import set_backend


def _split_plan() -> Plan:
    return every_mode_plans(build_toy())["split"]


def _accumulate_split(rank, world_size, plan_json, batches, micro):
    """k micro-batches per step (sync only on the last); counts the split slices' reduce-scatters (the
    PyTorch loop, whose collectives go through osdp.distributed.collectives)."""
    set_backend("python")  # this rank's process only
    reductions = []
    native = comm.native_reduce_scatter

    def counted(output, input, *args, **kwargs):
        reductions.append(input.numel() * input.element_size())
        return native(output, input, *args, **kwargs)

    comm.native_reduce_scatter = counted
    try:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        opt = sgd(model)
        losses, per_step = [], []
        for inputs, targets in batches:
            n = inputs.shape[0] // world_size
            mine_x, mine_y = inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]
            m, total, before = n // micro, 0.0, len(reductions)
            for i in range(micro):
                osdp.set_requires_gradient_sync(model, i == micro - 1)
                loss = model(mine_x[i * m:(i + 1) * m], mine_y[i * m:(i + 1) * m]) / micro
                loss.backward()
                total += loss.item()
            per_step.append(reductions[before:])
            opt.step()
            opt.zero_grad()
            losses.append(total)
        state = full_state(model)
    finally:
        comm.native_reduce_scatter = native
    return losses, state if rank == 0 else None, per_step


def test_accumulation_with_split_weights_reduces_once_per_window_and_equals_one_process():
    plan = _split_plan()
    batches = toy_batches(global_batch=12)  # 6 per rank: 1, 2 or 3 micro-batches
    ref = reference(build_toy, batches)
    traffic = {}
    for micro in (1, 3):
        out = run_ranks(_accumulate_split, 2, plan.to_json(), batches, micro, timeout=120)
        assert_matches_reference([[r[:2]] for r in out], ref, [f"split, {micro} micro-batches"])
        traffic[micro] = out[0][2]
    one, three = traffic[1], traffic[3]
    assert one[0], "the split plan reduced no slice gradient"
    # the same slices, each reduced once, whatever the number of micro-batches
    assert all(sorted(step) == sorted(one[0]) for step in one + three), traffic


def _clip(rank, world_size, plans_json, max_norm, clip="osdp"):
    """Each plan trained with gradients clipped every step: by ``osdp.clip_grad_norm_`` on the model, or (``clip=
    "torch"``) by ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``, as users write it."""

    results = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        opt = sgd(model)
        norms = []
        for inputs, targets in toy_batches():
            n = inputs.shape[0] // world_size
            model(inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]).backward()
            if clip == "torch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:
                norm = osdp.clip_grad_norm_(model, max_norm)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            opt.step()
            opt.zero_grad()
        state = full_state(model)  # collective: every rank takes part
        results.append((norms, state if rank == 0 else None))
    return results


def _assert_clipped_as_one_process(out, names, ref_norms, ref_state):
    for i, name in enumerate(names):
        for rank_results in out:  # every rank returns the global norm
            torch.testing.assert_close(torch.tensor(rank_results[i][0]), torch.tensor(ref_norms), atol=1e-5,
                                       rtol=1e-5, msg=name)
        state = out[0][i][1]
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, atol=1e-5, rtol=0, msg=f"{name}: {key}")


def _clip_reference(max_norm):
    model = build_toy()
    opt = sgd(model)
    norms = []
    for inputs, targets in toy_batches():
        model(inputs, targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return norms, cloned(model.state_dict())


def test_clip_grad_norm_across_replicated_sharded_and_split_units_equals_one_process():
    plans = every_mode_plans(build_toy())
    max_norm = 0.5  # below the toy's gradient norms: every step clips
    ref_norms, ref_state = _clip_reference(max_norm)
    assert min(ref_norms) > max_norm
    names = ["ddp", "mixed_a", "split"]
    out = run_ranks(_clip, 2, [plans[n].to_json() for n in names], max_norm, timeout=180)
    _assert_clipped_as_one_process(out, names, ref_norms, ref_state)


# Attention's key bias has a gradient of exactly zero (softmax ignores a shift), computed as rounding noise
# of ~1e-9 that differs between any two reduction orders; Adam's default eps (1e-8) would turn that noise
# into full-size steps. With this eps such noise moves nothing and real gradients move as before.
ADAM_EPS = 1e-4


def _adamw(rank, world_size, plans_json, kind):
    results = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS, **{kind: True})
        losses = train(model, toy_batches(), rank, world_size, optimizer=opt)
        state = full_state(model)  # collective: every rank takes part
        results.append((losses, state if rank == 0 else None))
    return results


def test_foreach_and_fused_adamw_equal_one_process():
    plans = every_mode_plans(build_toy())
    batches = toy_batches()
    for kind in ("foreach", "fused"):
        ref_model = build_toy()
        ref_losses = train(ref_model, batches, optimizer=torch.optim.AdamW(ref_model.parameters(), lr=1e-3,
                                                                             eps=ADAM_EPS, **{kind: True}))
        ref = (ref_losses, cloned(ref_model.state_dict()))
        names = ["mixed_a", "split"]
        out = run_ranks(_adamw, 2, [plans[n].to_json() for n in names], kind, timeout=180)
        assert_matches_reference(out, ref, [f"{n}, {kind} AdamW" for n in names])


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its users copy it: a step up the gradient, a second gradient there, and
    the weights put back through ``p.data = old_p`` before the base optimizer steps."""

    def __init__(self, params, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


def _step_beyond_one_parameter(model, kind, rank=0, world_size=1):
    """SAM's two steps, or L-BFGS (every parameter joined into one vector) with its closure; this rank's losses."""
    if kind == "sam":
        opt = SAM(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    losses = []
    for inputs, targets in toy_batches()[:3]:
        n = inputs.shape[0] // world_size
        inputs, targets = inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]
        if kind == "sam":
            loss = model(inputs, targets)
            loss.backward()
            opt.first_step()
            model(inputs, targets).backward()
            opt.second_step()
        else:
            def closure():
                opt.zero_grad()
                loss = model(inputs, targets)
                loss.backward()
                return loss
            loss = opt.step(closure)
        losses.append(loss.item())
    return losses


def _beyond_one_parameter(rank, world_size, plans_json, kind):
    return run_under_plans(rank, build_toy, plans_json,
                           lambda model: _step_beyond_one_parameter(model, kind, rank, world_size))


def test_optimizers_reaching_beyond_one_parameter_equal_one_process():
    """SAM assigns ``p.data`` (a no-op on a DTensor: the parameter's class makes it write, sharded or
    replicated) and L-BFGS joins every parameter's gradient into one vector (plain tensors beside sharded
    DTensors would not join: optimizers other than torch's per-parameter ones step DTensors only)."""
    plans = every_mode_plans(build_toy())
    names = ["mixed_a", "split"]
    for kind in ("sam", "lbfgs"):
        ref_model = build_toy()
        ref = (_step_beyond_one_parameter(ref_model, kind), cloned(ref_model.state_dict()))
        out = run_ranks(_beyond_one_parameter, 2, [plans[n].to_json() for n in names], kind, timeout=240)
        assert_matches_reference(out, ref, [f"{n}, {kind}" for n in names])


def _steps(step, model, rank=0, world_size=1) -> list[float]:
    """Train on the toy batches, each step's forward and backward as ``step(model, inputs, targets)`` writes them
    (it returns the loss), then SGD's step."""
    opt, losses = sgd(model), []
    for inputs, targets in toy_batches():
        n = inputs.shape[0] // world_size
        loss = step(model, inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _steps_under_plans(rank, world_size, plans_json, step):
    return run_under_plans(rank, build_toy, plans_json, lambda model: _steps(step, model, rank, world_size))


def _assert_steps_equal_one_process(step, names: list[str]) -> None:
    plans = every_mode_plans(build_toy())
    ref_model = build_toy()
    ref = (_steps(step, ref_model), cloned(ref_model.state_dict()))
    out = run_ranks(_steps_under_plans, 2, [plans[n].to_json() for n in names], step, timeout=180)
    assert_matches_reference(out, ref, [f"{n}, {step.__name__}" for n in names])


def _two_losses_through_one_graph(model, inputs, targets):
    """Multi-task code: two losses on one forward, each given its own backward, the first keeping the graph."""
    logits = model(inputs)
    task = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    task.backward(retain_graph=True)
    logits.square().mean().backward()
    return task


def test_two_backwards_through_one_retained_graph_equal_one_process():
    """Checkpointed units recompute in both backwards: replicated ones (mixed_a) failed on their DTensor views,
    selective ones (mixed_b) on PyTorch's kept outputs, used up by the first."""
    _assert_steps_equal_one_process(_two_losses_through_one_graph, ["mixed_a", "mixed_b"])


def _through_functional_call(model, inputs, targets):
    """As code written for ``torch.func`` runs its model: the call puts the parameters it was given (the model's
    own) back in place after the forward."""
    loss = torch.func.functional_call(model, dict(model.named_parameters()), (inputs, targets))
    loss.backward()
    return loss


def test_functional_call_with_the_models_own_parameters_equals_one_process():
    """Replicated units lost every gradient (their views were back in place when the backward ended, and were
    taken for parameters replaced during the step): the model did not train under ``ddp`` or split plans. Under
    plans checkpointing a replicated unit or the root (mixed_a, mixed_b), the recompute in backward computed with
    the DTensors the call had put back, and a bare AssertionError ended the step."""
    _assert_steps_equal_one_process(_through_functional_call, ["ddp", "split", "mixed_a", "mixed_b"])


def _under_anomaly_detection(model, inputs, targets):
    with torch.autograd.detect_anomaly():
        loss = model(inputs, targets)
        loss.backward()
    return loss


def test_anomaly_detection_trains_as_one_process():
    """Anomaly detection checks each backward node's gradients for NaN; a split weight's is a DTensor, for whose
    check DTensor had no strategy (NotImplementedError under split plans only)."""
    _assert_steps_equal_one_process(_under_anomaly_detection, ["split"])


def _out_of_memory(*_):
    raise RuntimeError("out of memory (raised by the test)")


def _steps_cut_short_then_whole(model, inputs, targets):
    """A loop going on after an exception, as loops do: fairseq skips a batch that ran out of memory in backward,
    accelerate's find_executable_batch_size retries after one in forward; and torch.autograd.grad with respect to
    the parameters, which one process answers and a wrapped model refuses, the same under every plan."""
    wrapped = isinstance(model, FSDPModule)
    try:
        loss = model(inputs, targets)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        assert not wrapped and len(grads) == len(list(model.parameters()))
    except RuntimeError as e:
        assert wrapped and str(e).startswith("torch.autograd.grad asked for the gradient of parameter 'ln_f."), e
    for where, register in (("backward", model.blocks[0].mlp.fc.register_full_backward_pre_hook),
                            ("forward", model.blocks[1].mlp.fc.register_forward_pre_hook)):
        handle = register(_out_of_memory)
        try:
            model(inputs, targets).backward()
            raise AssertionError(f"the {where} did not raise")
        except RuntimeError as e:
            assert "raised by the test" in str(e), e
        finally:
            handle.remove()
        model.zero_grad()
    loss = model(inputs, targets)
    loss.backward()
    return loss


def test_steps_after_an_exception_and_a_refused_gradient_call_equal_one_process():
    """Under every plan. A backward that raised left FSDP2 waiting for its end (the next backward reduced
    nothing), a rank of two segfaulted at the next forward under one plan, and replicated units kept gradients
    the user's zero_grad could not reach; torch.autograd.grad w.r.t. the parameters returned each rank's own
    gradients under replicated and zero2 units (a silent divergence), and torch's refusal elsewhere."""
    _assert_steps_equal_one_process(_steps_cut_short_then_whole, list(every_mode_plans(build_toy())))


def _gan():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    critic = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    return generator, critic


def _gan_steps(generator, critic, rank=0, world_size=1):
    """Two GAN steps as Lightning's manual optimization takes them: each optimizer's turn freezes every parameter
    of the other optimizer through its param groups (``toggle_optimizer``), so the generator runs frozen whole in
    the critic's turn, with gradients on."""
    opts = [torch.optim.Adam(generator.parameters(), lr=1e-2, eps=1e-3),
            torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)]

    def turn(opt, loss_of):
        was = {p: p.requires_grad for o in opts for g in o.param_groups for p in g["params"]}
        for o in opts:
            for g in o.param_groups:
                for p in g["params"]:
                    p.requires_grad = was[p] if o is opt else False
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for p, requires_grad in was.items():
            p.requires_grad = requires_grad
        return loss.item()

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        real, z = (torch.randn(8, n, generator=g).chunk(world_size)[rank] for n in (16, 8))
        ones, zeros = torch.ones(len(z), 1), torch.zeros(len(z), 1)
        losses.append(turn(opts[0], lambda: F.binary_cross_entropy_with_logits(critic(generator(z)), ones)))
        losses.append(turn(opts[1], lambda: (F.binary_cross_entropy_with_logits(critic(real), ones) +
                                             F.binary_cross_entropy_with_logits(critic(generator(z).detach()), zeros)) / 2))
    return losses


def _gan_under_plans(rank, world_size, plans_json):
    out = []
    for generator_plan, critic_plan in plans_json:
        generator, critic = _gan()
        osdp.wrap(generator, plan=generator_plan)
        osdp.wrap(critic, plan=critic_plan)
        losses = _gan_steps(generator, critic, rank, world_size)
        state = {**{f"g.{k}": v for k, v in full_state(generator).items()},
                 **{f"c.{k}": v for k, v in full_state(critic).items()}}  # collectives: every rank takes part
        out.append((losses, state if rank == 0 else None))
    return out


def test_a_model_frozen_whole_for_a_forward_trains_its_next_turn_as_one_process():
    """A zero2 unit (and the root) stayed gathered after the generator's frozen forward in the critic's turn,
    registering the gathered parameters: the generator's next turn unfroze the parameters its optimizer holds,
    not those, so zero2 units did not train (mixed plans: 8e-3 off one process, silently) or nothing did (zero2:
    "element 0 of tensors does not require grad"). A forward through which no backward can come now puts its
    units at rest as a forward without gradients does."""
    from training_check import plan_kinds

    generator, critic = _gan()
    losses = _gan_steps(generator, critic)
    ref = (losses, {**{f"g.{k}": v for k, v in cloned(generator.state_dict()).items()},
                    **{f"c.{k}": v for k, v in cloned(critic.state_dict()).items()}})
    plans_g, plans_c = (plan_kinds(m) for m in _gan())
    names = [("mixed", "mixed")]  # zero2 units among every mode
    out = run_ranks(_gan_under_plans, 2, [(plans_g[a].to_json(), plans_c[b].to_json()) for a, b in names],
                    timeout=180)
    assert_matches_reference(out, ref, [f"generator {a}, critic {b}" for a, b in names])


def _train_then_evaluate(rank, world_size, plans_json):
    results = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        batches = toy_batches()
        train(model, batches[:2], rank, world_size)
        model.eval()
        with torch.no_grad():
            logits = model(batches[2][0])  # every rank, the whole batch: the same logits on each
            if rank == 0:  # as DDP users save and log: on rank 0 alone, which must not leave it gathering apart
                torch.save(model.state_dict(), io.BytesIO())
                assert all(isinstance(p, DTensor) for _, p in model.named_parameters())  # at rest, as logged
            torch.testing.assert_close(model(batches[2][0]), logits, atol=0, rtol=0)
        model.train()
        # training goes on after evaluation, with an optimizer made then (train makes one): it must get the
        # shards, not the parameters a zero2 unit would still hold gathered after a forward without backward
        losses = train(model, batches[2:], rank, world_size)
        state = full_state(model)  # collective: every rank takes part
        results.append((logits, losses, state if rank == 0 else None))
    return results


def test_evaluation_without_gradients_after_training_equals_one_process():
    plans = every_mode_plans(build_toy())
    batches = toy_batches()
    ref_model = build_toy()
    train(ref_model, batches[:2])
    ref_model.eval()
    with torch.no_grad():
        ref_logits = ref_model(batches[2][0])
    ref_model.train()
    ref_losses = train(ref_model, batches[2:])
    ref_state = cloned(ref_model.state_dict())
    names = ["fsdp", "mixed_b", "split"]
    out = run_ranks(_train_then_evaluate, 2, [plans[n].to_json() for n in names], timeout=180)
    for i, name in enumerate(names):
        for rank_results in out:
            torch.testing.assert_close(rank_results[i][0], ref_logits, atol=1e-5, rtol=0, msg=name)
    assert_matches_reference([[r[1:] for r in rank_results] for rank_results in out], (ref_losses, ref_state),
                             [f"{n} after evaluation" for n in names])


def _evaluate_first(rank, world_size, plans_json):
    """Evaluation under ``torch.inference_mode`` before any training (Lightning's sanity check, a zero-shot
    score), training, evaluation again, training."""
    results = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        results.append(_inference_then_training(model, rank, world_size))
        state = full_state(model)  # collective: every rank takes part
        results[-1] += (state if rank == 0 else None,)
    return results


def _inference_then_training(model, rank=0, world_size=1):
    batches, logits, losses = toy_batches(), [], []
    for i in (0, 2):
        model.eval()
        with torch.inference_mode():
            logits.append(model(batches[i][0]).clone())  # every rank, the whole batch
        model.train()
        losses += train(model, batches[i:i + 2], rank, world_size)
    return logits, losses


def test_evaluation_in_inference_mode_before_training_equals_one_process():
    # FSDP2 makes a unit's gathered parameters at its first gather: made in inference mode they would be
    # inference tensors, which no gather outside it may write to again
    plans = every_mode_plans(build_toy())
    ref_model = build_toy()
    ref_logits, ref_losses = _inference_then_training(ref_model)
    names = ["zero2", "fsdp", "mixed_b", "split"]
    out = run_ranks(_evaluate_first, 2, [plans[n].to_json() for n in names], timeout=180)
    for i, name in enumerate(names):
        for rank_results in out:
            for got, want in zip(rank_results[i][0], ref_logits):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
    assert_matches_reference([[r[1:] for r in rank_results] for rank_results in out],
                             (ref_losses, cloned(ref_model.state_dict())), [f"{n}, inference first" for n in names])


def _autocast(rank, world_size, plans_json):
    from osdp.split import SplitLinear

    results = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        opt = sgd(model)
        losses, dtypes = [], set()
        for m in model.modules():  # a split Linear computes in the autocast dtype, as nn.Linear does
            if isinstance(m, SplitLinear):
                m.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
        for inputs, targets in toy_batches():
            n = inputs.shape[0] // world_size
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(inputs[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = full_state(model)  # collective: every rank takes part
        results.append((losses, state if rank == 0 else None, dtypes))
    return results


def test_cpu_autocast_bf16_trains_as_one_process_under_autocast():
    plans = every_mode_plans(build_toy())
    ref_model, ref_losses = build_toy(), []
    opt = sgd(ref_model)
    for inputs, targets in toy_batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref_model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = cloned(ref_model.state_dict())
    names = ["mixed_a", "split"]
    out = run_ranks(_autocast, 2, [plans[n].to_json() for n in names], timeout=180)
    # bf16 products: the ranks' halves of the batch round differently than the whole batch does
    per_rank = [[r[:2] for r in rank_results] for rank_results in out]
    assert_matches_reference(per_rank, (ref_losses, ref_state), [f"{n} under autocast" for n in names], atol=2e-2)
    for i, n in enumerate(names):  # fp32 parameters stay fp32
        assert all(v.dtype == torch.float32 for v in out[0][i][1].values()), n
    assert out[0][names.index("split")][2] == {torch.bfloat16}


def _bf16_reference(batches, world_size, max_norm=None):
    """One process computing in bf16 (a bf16 copy of the fp32 parameters each step) on the ranks' slices of
    the batch in turn, their gradients cast to fp32 and averaged in fp32 for the fp32 optimizer: the
    arithmetic a plan's mixed_precision 'bf16' (bf16 parameters, fp32 reduction) does on world_size ranks.
    With ``max_norm``: the gradients clipped to it, and the norms instead of the losses."""
    model = build_toy()
    opt, losses, norms = sgd(model), [], []
    for inputs, targets in batches:
        compute_copy = copy.deepcopy(model).to(torch.bfloat16)
        n, loss_sum = inputs.shape[0] // world_size, 0.0
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world_size):
            compute_copy.zero_grad()
            loss = compute_copy(inputs[r * n:(r + 1) * n], targets[r * n:(r + 1) * n])
            loss.backward()
            loss_sum += loss.item()
            for g, q in zip(grads, compute_copy.parameters()):
                g += q.grad.float()
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world_size
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / world_size)
    return (losses if max_norm is None else norms), cloned(model.state_dict())


def test_torch_clip_grad_norm_takes_every_bf16_plan_and_equals_one_process():
    """In bf16 replicated units are FSDP2's ``replicate`` on the mesh the sharded units are sharded on: their
    gradients and the sharded units' take part in one ``torch.nn.utils.clip_grad_norm_``, which refused a plan
    mixing the two when replicated units ran on a mesh of their own."""
    plans = {}
    for name, plan in every_mode_plans(build_toy()).items():
        if name == "split":  # rounds apart from nn.Linear in bf16 (test_bf16_parameters_with_fp32_reduction...)
            continue
        settings = plan.to_dict()
        settings.pop("hash")
        plans[name] = Plan.from_dict({**settings, "mixed_precision": "bf16"})
    assert any(u.mode == "replicate" for u in plans["mixed_a"].units)
    assert any(u.mode != "replicate" for u in plans["mixed_a"].units)
    max_norm = 0.5
    ref_norms, ref_state = _bf16_reference(toy_batches(), 2, max_norm)
    assert min(ref_norms) > max_norm  # every step clips
    out = run_ranks(_clip, 2, [p.to_json() for p in plans.values()], max_norm, "torch", timeout=180)
    _assert_clipped_as_one_process(out, list(plans), ref_norms, ref_state)


def test_bf16_parameters_with_fp32_reduction_train_as_one_process_in_bf16():
    plans = {}
    for name, plan in every_mode_plans(build_toy()).items():
        settings = plan.to_dict()
        settings.pop("hash")
        plans[name] = Plan.from_dict({**settings, "mixed_precision": "bf16"})
    batches = toy_batches()
    out = run_ranks(train_under_plans, 2, build_toy, batches, [p.to_json() for p in plans.values()], timeout=180)
    ref = _bf16_reference(batches, 2)  # training in fp32 differs from it by ~5e-2 in the losses
    names = [f"{n} in bf16" for n in plans]
    exact = [i for i, n in enumerate(plans) if n != "split"]
    assert_matches_reference([[r[i] for i in exact] for r in out], ref, [names[i] for i in exact])
    # a split Linear rounds its product to bf16 before adding the bias, where nn.Linear's addmm rounds once:
    # parameters agree to bf16's resolution (2**-8 relative), not to fp32's (measured: 3.7e-3), and the bf16
    # losses (8-21 here, where bf16 steps by 1/16-1/8) to within one such step: on the machine this was written on
    # they came out equal, on one with AVX2 and no AVX-512 the third differs by 1/32 (its bf16 matmuls round apart)
    split = list(plans).index("split")
    assert_matches_reference([[r[split]] for r in out], ref, [names[split]], atol=1e-2, loss_rtol=2**-8)
    for name, (losses, state) in zip(plans, out[0]):  # the optimizer keeps fp32 parameters
        assert all(v.dtype == torch.float32 for v in state.values()), name


class _Tower(nn.Module):
    def __init__(self, d_in, h=64, d_out=16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d_in if i == 0 else h, h), nn.GELU()) for i in range(2))
        self.proj = nn.Linear(h, d_out, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.proj(x), dim=-1)


class _TwoTowers(nn.Module):
    """CLIP's shape: two encoders, and a temperature the training and evaluation loops read off the root (a
    scalar, which FSDP2 cannot shard; a shift of the text embeddings is the root's sharded parameter)."""

    def __init__(self):
        super().__init__()
        self.visual, self.text = _Tower(12), _Tower(10)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.text_shift = nn.Parameter(torch.zeros(16))

    def forward(self, image, text):
        return self.visual(image), self.text(text) + self.text_shift


def _two_towers():
    torch.manual_seed(0)
    return _TwoTowers()


def _image_text_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 10, generator=g)) for _ in range(3)]


def _contrastive_loop(model, optimizer_made, rank=0, world_size=1):
    """CLIP's loop: each step evaluates the whole batch (scores scaled by ``model.logit_scale`` outside the
    forward), then trains on this rank's half, clamping the temperature after the step. ``optimizer_made``:
    "before" the loop from model.parameters(); "after" the first evaluation, in groups holding the temperature
    itself and the towers' parameters, with one more evaluation between each backward and step. One process
    trains each half's loss in turn, averaged, as the two ranks do."""

    def evaluate():
        model.eval()
        with torch.no_grad():
            image_emb, text_emb = model(image, text)
            out.append(model.logit_scale.exp() * image_emb @ text_emb.T)
        model.train()

    opt = sgd(model) if optimizer_made == "before" else None
    out = []
    for image, text in _image_text_batches():
        evaluate()
        if opt is None:
            opt = torch.optim.SGD([{"params": [model.logit_scale, model.text_shift], "lr": 0.05},
                                   {"params": model.visual.parameters()}, {"params": model.text.parameters()}],
                                  lr=0.2, momentum=0.9)
        n = image.shape[0] // world_size
        image_emb, text_emb = model(image[rank * n:(rank + 1) * n], text[rank * n:(rank + 1) * n])
        halves = []
        for a in range(0, n, 4):
            logits = model.logit_scale.exp() * image_emb[a:a + 4] @ text_emb[a:a + 4].T
            halves.append((F.cross_entropy(logits, torch.arange(4)) + F.cross_entropy(logits.T, torch.arange(4))) / 2)
        loss = sum(halves) / len(halves)
        loss.backward()
        if optimizer_made == "after":
            evaluate()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        out.append(loss.item())
    return out


def _contrastive(rank, world_size, plans_json, optimizer_made):
    return run_under_plans(rank, _two_towers, plans_json,
                           lambda model: _contrastive_loop(model, optimizer_made, rank, world_size))


def test_a_loop_reading_the_roots_parameters_after_evaluation_equals_one_process():
    # FSDP2 keeps its root gathered after a forward without gradients and CLIP's evaluation reads the temperature
    # there; under every plan it must read a plain tensor, and an optimizer built or stepped then must step the
    # parameters training uses
    plans = every_mode_plans(_two_towers())
    for optimizer_made in ("before", "after"):
        reference_model = _two_towers()
        ref = _contrastive_loop(reference_model, optimizer_made)
        ref_state = cloned(reference_model.state_dict())
        out = run_ranks(_contrastive, 2, [p.to_json() for p in plans.values()], optimizer_made, timeout=180)
        for i, name in enumerate(plans):
            case = f"{name}, optimizer made {optimizer_made}"
            for rank_out in out:
                for got, want in zip(rank_out[i][0], ref):
                    if isinstance(want, torch.Tensor):  # every rank evaluates the whole batch
                        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=case)
            losses = [(a + b) / 2 for a, b in zip(out[0][i][0], out[1][i][0]) if not isinstance(a, torch.Tensor)]
            assert max(abs(a - b) for a, b in zip(losses, [r for r in ref if not isinstance(r, torch.Tensor)])) <= 1e-5, case
            for key, want in ref_state.items():
                torch.testing.assert_close(out[0][i][1][key], want, atol=1e-5, rtol=0, msg=f"{case}: {key}")
