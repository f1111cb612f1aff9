"""Models written by others, wrapped by a budget search at three budgets: the same training as one process, and
the budget kept by PyTorch's own ``FSDPMemTracker``.

Each style (``model_styles``) is wrapped with ``osdp.wrap(model, device_mem=B, example_input=...)`` at the least
budget any plan needs, halfway to what the fastest plan needs, and that; trained on 2 gloo ranks
(each its slice of the global batch; SGD with momentum, which the search is told it prices) and compared
with one process training the global batch; its steps after
the optimizer's state exists are measured by ``FSDPMemTracker``; ``osdp.check_replicas`` after every step.
"""

from __future__ import annotations

import contextlib

import model_styles as styles
import pytest
import torch
from dist_harness import run_ranks
from training_check import full_state

import osdp

STEPS = 4
WARMUP = 2  # steps before the optimizer's state exists and the reducer has its final buckets
ROWS = 4  # per rank: the example's micro-batch
ATOL = 1e-5

# what the search runs the example with (any scalar of the output: its cost is the model's)
PLANNING_LOSS = {
    "lambda_gpt": lambda out: out[1],
    "seq2seq": lambda out: out.square().mean(),
    "cnn": lambda out: out[0].square().mean() + out[1].square().mean(),
    "t5": lambda out: out.loss,
    "recurrent": lambda out: out,
    "shared_layer": lambda out: out,
    "vit": lambda out: out.square().mean(),
    "lora": lambda out: out,
    "padded": lambda out: out.square().mean(),
    "packed": lambda out: out,
    "dict_io": lambda out: out["loss"],
    "inplace": lambda out: out,
    "weight_norm": lambda out: out.loss,
    "user_ckpt": lambda out: out[1],
    "moe": lambda out: out,
    "layerdrop": lambda out: out,
    "scalar_params": lambda out: out,
    "data_branch": lambda out: out,
    "gru_attention": lambda out: out.square().mean(),
    "channels_last": lambda out: out,
    "task_heads": lambda out: out,
    "momentum_encoder": lambda out: out,
    "shared_module": lambda out: out,
    "data_ema": lambda out: out,
    "buffer_blocks": lambda out: out,
    "pruned_weight_norm": lambda out: out,
    "attention_maps": lambda out: out,
    "fourier": lambda out: out,
}


def _train(model, style, steps, rank=0, world_size=1, measure=False):
    from osdp._torch_private import FSDPMemTracker

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, peaks = [], []
    for step, batch in enumerate(steps):
        n = batch[0].shape[0] // world_size
        mine = tuple(t[rank * n:(rank + 1) * n] for t in batch)
        tracker = FSDPMemTracker(model, opt) if measure and step >= WARMUP else None
        with tracker if tracker is not None else contextlib.nullcontext():
            # the output held through backward and optimizer step, as ``logits, loss = model(x, y)`` holds it
            out = styles.call(model, styles.inputs_of(style, mine))
            loss = styles.loss_of(style, out, mine, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if tracker is not None:
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
            peaks.append(snapshot["Total"])
        if world_size > 1:
            osdp.check_replicas(model)
        losses.append(loss.item())
    return losses, peaks


def _wrap(style, budget, example):
    model = styles.build(style)
    osdp.wrap(model, device_mem=budget, example_input=styles.inputs_of(style, example),
              loss_fn=PLANNING_LOSS[style], optimizer="sgd-momentum")
    return model


def _under_searched_plans(rank, world_size, style, steps):
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    try:
        _wrap(style, 1024, example)
        raise AssertionError("1 KiB was enough")
    except osdp.BudgetTooSmall as e:
        least = e.min_peak_bytes
    most = osdp.plan_of(_wrap(style, "64GiB", example)).predicted_peak_bytes
    out = []
    for fraction in (0.0, 0.5, 1.0):
        budget = int(least + fraction * (most - least))
        model = _wrap(style, budget, example)
        losses, peaks = _train(model, style, steps, rank, world_size, measure=True)
        plan = osdp.plan_of(model)
        state = full_state(model)  # collective: every rank takes part
        out.append((budget, plan.summary(), plan.predicted_peak_bytes, losses, peaks, state if rank == 0 else None))
    return out


@pytest.mark.parametrize("style", list(styles.STYLES))
def test_a_model_written_by_others_trains_as_one_process_within_its_budget(style):
    steps = styles.batches(style, 2 * ROWS, STEPS)
    reference = styles.build(style)
    ref_losses, _ = _train(reference, style, steps)
    ref_state = reference.state_dict()
    ranks = run_ranks(_under_searched_plans, 2, style, steps, timeout=600)
    assert len({summary for _, summary, *_ in ranks[0]}) >= 2, "the budgets gave one plan"
    for i, (budget, summary, predicted, _, _, state) in enumerate(ranks[0]):
        losses = [sum(r[i][3][s] for r in ranks) / 2 for s in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (summary, losses, ref_losses)
        assert set(state) == set(ref_state), summary
        diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state if ref_state[k].numel())
        assert diff <= ATOL, (summary, diff)
        assert predicted <= budget, (summary, predicted, budget)
        for r in ranks:
            assert max(r[i][4]) <= budget, (f"{summary}: measured {max(r[i][4])} B over the budget {budget} B "
                                            f"(predicted {predicted} B)")


# what a forward of the example shows and the model's structure does not: a parameter used outside its module's
# forward (the tied head's ``F.linear(x, wte.weight)``, a no-grad statistic of a weight), a module writing to its
# input, experts called depending on the data
TRACED_BASELINE_STYLES = ("lambda_gpt", "user_ckpt", "weight_norm", "inplace", "moe", "data_branch")


def _under_baselines_with_an_example(rank, world_size, steps_by_style):
    out = {}
    for style, steps in steps_by_style.items():
        example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
        model = styles.build(style)
        osdp.wrap(model, strategy="fsdp", example_input=styles.inputs_of(style, example))
        losses, _ = _train(model, style, steps, rank, world_size)
        out[style] = (losses, full_state(model))
    return out


def test_a_baseline_given_an_example_trains_as_one_process():
    """``wrap(model, strategy=..., example_input=...)``: the baseline's units are found as the search finds
    them, so models that FSDP2 per module cannot train (each of these fails without the example) train as one
    process."""
    steps_by_style = {style: styles.batches(style, 2 * ROWS, STEPS) for style in TRACED_BASELINE_STYLES}
    ranks = run_ranks(_under_baselines_with_an_example, 2, steps_by_style, timeout=300)
    for style, steps in steps_by_style.items():
        reference = styles.build(style)
        ref_losses, _ = _train(reference, style, steps)
        losses = [sum(r[style][0][s] for r in ranks) / 2 for s in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (style, losses, ref_losses)
        state, ref_state = ranks[0][style][1], reference.state_dict()
        assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) <= ATOL, style


def _first_step_warnings(rank, world_size):
    import warnings

    steps = styles.batches("lambda_gpt", 4 * ROWS, 1)
    example = tuple(t[:ROWS] for t in steps[0])
    try:
        _wrap("lambda_gpt", 1024, example)
    except osdp.BudgetTooSmall as e:
        least = e.min_peak_bytes
    caught = {}
    for rows in (ROWS, 2 * ROWS):  # the example's micro-batch, then twice it
        model = _wrap("lambda_gpt", least, example)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                model(*(t[:rows] for t in steps[0]))[1].backward()
                opt.step()
                opt.zero_grad()
        caught[rows] = [str(w.message) for w in seen if issubclass(w.category, osdp.BudgetExceededWarning)]
    return caught


def test_a_first_step_over_the_budget_warns_with_the_figures():
    for caught in run_ranks(_first_step_warnings, 2, timeout=300):
        assert caught[ROWS] == []  # within the budget: silent
        (message,) = caught[2 * ROWS]  # the first step only
        assert "over the budget" in message and "lower by at least" in message, message


def _random_state_around_wrap(rank, world_size):
    model = styles.build("layerdrop")  # its forward draws random numbers; the describe runs it on rank 0
    torch.manual_seed(1234 + rank)
    before = torch.get_rng_state()
    osdp.wrap(model, device_mem="64MiB", example_input=styles.batches("layerdrop", ROWS, 1)[0],
              loss_fn=PLANNING_LOSS["layerdrop"])
    return torch.equal(torch.get_rng_state(), before)


def test_wrapping_leaves_the_random_numbers_as_they_were_on_every_rank():
    """The calibration and the describe draw numbers: a user's dropout masks after osdp.wrap are an unwrapped
    run's."""
    assert run_ranks(_random_state_around_wrap, 2, timeout=300) == [True, True]


# sharded blocks under the model's own reentrant checkpoint: measured 4.6 to 8.7 KB over these plans' predicted
# peaks before FSDP2's second gathered copy in the recomputed forward was priced
REENTRANT_PLANS = (
    {"transformer.h.0": ("zero3", False), "transformer.h.1": ("zero3", False), "transformer.wpe": ("replicate", False),
     "": ("zero3", False)},
    {"transformer.h.0": ("zero3", False), "transformer.h.1": ("zero2", True), "": ("zero2", False)},
)


def _reentrant_checkpoint_peaks(rank, world_size, reentrant):
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_descriptions
    from osdp.schema.plan import Plan, UnitPlan

    steps = styles.batches("user_ckpt", 2 * ROWS, STEPS)
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    machine = calibrate()
    model = styles.UserCheckpointedGPT(reentrant=reentrant)
    descriptions = planning_descriptions(model, example, loss_fn=PLANNING_LOSS["user_ckpt"])
    out = []
    for modes in REENTRANT_PLANS:
        plan = Plan(units=[UnitPlan(p, mode=m, checkpoint=c) for p, (m, c) in modes.items()], batch_size=ROWS,
                    world_size=world_size)
        (description,) = [d for d in descriptions if set(d.paths) == set(modes)]
        flagged = {u.path for u in description.units if u.costs["fp32"].run_in_backward}
        predicted = predict(description, plan, machine.device_info, optimizer="sgd-momentum",
                            calibration=machine.calibration).peak_bytes
        torch.manual_seed(0)
        model = styles.UserCheckpointedGPT(reentrant=reentrant)
        osdp.wrap(model, plan=plan)
        _, peaks = _train(model, "user_ckpt", steps, rank, world_size, measure=True)
        out.append((flagged, predicted, max(peaks)))
    return out


def test_blocks_under_the_models_own_reentrant_checkpoint_are_priced_within_pytorchs_tracker():
    """A reentrant checkpoint runs a block's forward without autograd, then again in backward, where FSDP2
    gathers the block while its prefetched flat buffer is still held: the describe flags such blocks
    (tests/describe/test_profile.py) and the cost model prices the second copy."""
    ranks = run_ranks(_reentrant_checkpoint_peaks, 2, True, timeout=300)
    for i, modes in enumerate(REENTRANT_PLANS):
        assert ranks[0][i][0] == {"transformer.h.0", "transformer.h.1"}, modes
        for r in ranks:
            _, predicted, measured = r[i]
            assert measured <= predicted, (modes, measured, predicted)


# the encoder checkpointed (split or not): its recomputed backward runs while the target embedding, which takes token
# ids after it, still holds its unsharded parameters and gradients
NO_GRADIENT_INPUT_PLANS = tuple(
    {"source_embedding": ("zero3", 1, False), "encoder.0": ("zero3", split, True),
     "encoder.1": ("zero3", split, True), "target_embedding": ("zero3", 1, False), "": ("zero3", 1, False)}
    for split in (4, 1))


def _no_gradient_input_peaks(rank, world_size):
    import dataclasses

    from osdp._torch_private import FSDPMemTracker
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_description
    from osdp.schema.plan import Plan, UnitPlan

    g = torch.Generator().manual_seed(1)
    steps = [styles._source_and_target(2 * ROWS, g) for _ in range(STEPS)]
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    machine = calibrate()
    description = planning_description(styles.DecoderLoopSeq2Seq(), example, loss_fn=lambda out: out.square().mean())
    out = []
    for units in NO_GRADIENT_INPUT_PLANS:
        plan = Plan(units=[UnitPlan(p, mode=m, split=k, checkpoint=c) for p, (m, k, c) in units.items()],
                    batch_size=ROWS, world_size=world_size)
        assert set(description.paths) == set(units)
        flagged = {u.path for u in description.units if u.costs["fp32"].reduced_at_end and u.path}
        unflagged = dataclasses.replace(description, units=[
            dataclasses.replace(u, costs={p: dataclasses.replace(c, reduced_at_end=False) for p, c in u.costs.items()})
            for u in description.units])
        predicted, as_if_reduced_in_backward = (
            predict(d, plan, machine.device_info, optimizer="sgd-momentum", calibration=machine.calibration).peak_bytes
            for d in (description, unflagged))
        torch.manual_seed(0)
        model = styles.DecoderLoopSeq2Seq()
        osdp.wrap(model, plan=plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        peaks = []
        for step, (src, tgt) in enumerate(steps):
            mine = (src[rank * ROWS:(rank + 1) * ROWS], tgt[rank * ROWS:(rank + 1) * ROWS])
            tracker = FSDPMemTracker(model, opt) if step >= WARMUP else contextlib.nullcontext()
            with tracker:
                logits = model(*mine)  # held through the step, as the description prices it
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[1].flatten()).backward()
                opt.step()
                opt.zero_grad()
            if step >= WARMUP:
                (snapshot,) = tracker.get_tracker_snapshot("peak").values()
                peaks.append(snapshot["Total"])
        out.append((flagged, predicted, as_if_reduced_in_backward, max(peaks)))
    return out


def test_a_unit_whose_inputs_need_no_gradient_holds_its_unsharded_gradients_to_the_end_of_backward():
    """FSDP2 reduces a unit's gradients when the gradients of its inputs are computed; a unit that takes token ids
    (a sequence-to-sequence model's target embedding, called after the encoder) is reduced only as the whole
    backward ends, holding its unsharded parameters and gradients through the encoder's backward. Priced so, the
    peak is within PyTorch's tracker; priced as reduced after its own backward, it was over (by 4% with the
    encoder checkpointed and split)."""
    for rank in run_ranks(_no_gradient_input_peaks, 2, timeout=300):
        for units, (flagged, predicted, as_if_reduced_in_backward, measured) in zip(NO_GRADIENT_INPUT_PLANS, rank):
            assert flagged == {"source_embedding", "target_embedding"}, units
            assert measured <= predicted, (units, measured, predicted)
            assert as_if_reduced_in_backward < measured, (units, as_if_reduced_in_backward, measured)


# the stem checkpointed: its ReLU's output stays alive, saved by the first stage's convolution
SAVED_TWICE_PLANS = tuple(
    {"stem": ("replicate", True), "stages.0": ("replicate", False), "stages.1": ("replicate", stage_1),
     "stages.2": ("replicate", stage_2), "head": ("replicate", False), "": ("zero2", False)}
    for stage_1, stage_2 in ((False, True), (True, "selective")))


def _saved_twice_peaks(rank, world_size):
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_description
    from osdp.schema.plan import Plan, UnitPlan

    steps = styles.batches("channels_last", 2 * ROWS, STEPS)
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    machine = calibrate()
    description = planning_description(styles.ChannelsLastNet(torch.contiguous_format), example, loss_fn=lambda out: out)
    out = []
    for units in SAVED_TWICE_PLANS:
        plan = Plan(units=[UnitPlan(p, mode=m, checkpoint=c) for p, (m, c) in units.items()], batch_size=ROWS,
                    world_size=world_size)
        predicted = predict(description, plan, machine.device_info, optimizer="sgd-momentum",
                            calibration=machine.calibration).peak_bytes
        torch.manual_seed(0)
        model = styles.ChannelsLastNet(torch.contiguous_format)
        osdp.wrap(model, plan=plan)
        _, peaks = _train(model, "channels_last", steps, rank, world_size, measure=True)
        out.append((predicted, max(peaks)))
    return out


def test_a_checkpointed_unit_whose_output_the_next_unit_saves_keeps_it_alive():
    """A stem ending in a ReLU saves its output, and the first stage's convolution saves the same storage as its
    input: checkpointing the stem frees its other activations, not that one. Priced as freed, a plan checkpointing
    the stem and the last stage measured 20,240 B over its prediction (2 gloo ranks, FSDPMemTracker)."""
    for rank in run_ranks(_saved_twice_peaks, 2, timeout=300):
        for units, (predicted, measured) in zip(SAVED_TWICE_PLANS, rank):
            assert measured <= predicted, (units, measured, predicted)


# the trunk reduced as the backward ends, the middle Linear split: the end of the backward is the step's peak
FINAL_REDUCE_PLANS = tuple(
    {"trunk": (trunk, 1), "mid": ("zero3", k), "": ("replicate", 1)} for trunk, k in (("zero3", 8), ("zero2", 4)))


def _final_reduce_peaks(rank, world_size):
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_description
    from osdp.schema.plan import Plan, UnitPlan

    steps = styles.batches("task_heads", 2 * ROWS, STEPS)
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    machine = calibrate()
    description = planning_description(styles.build("task_heads"), example, loss_fn=lambda out: out)
    out = []
    for units in FINAL_REDUCE_PLANS:
        plan = Plan(units=[UnitPlan(p, mode=m, split=k) for p, (m, k) in units.items()], batch_size=ROWS,
                    world_size=world_size)
        prediction = predict(description, plan, machine.device_info, optimizer="sgd-momentum",
                             calibration=machine.calibration)
        model = styles.build("task_heads")
        osdp.wrap(model, plan=plan)
        _, peaks = _train(model, "task_heads", steps, rank, world_size, measure=True)
        out.append((prediction.peak_bytes, prediction.breakdown["peak_moment"], max(peaks)))
    return out


def test_the_final_reduce_of_a_unit_reduced_as_the_backward_ends_holds_its_new_shard_beside_its_input():
    """FSDP2 reduces a unit whose inputs need no gradient in the root's final callback: its unsharded gradients, the
    reduce-scatter input they are copied into and the new shard coexist. Priced without the shard, a plan whose
    peak that is measured 120,440 B (8.6%) over its prediction; what is left is 184 B, the middle unit's bias
    gradient, which FSDP2 still holds then (a reduce-scatter input kept, 1,024 B, against the batch counted in the
    prediction and not by the tracker)."""
    for rank in run_ranks(_final_reduce_peaks, 2, timeout=300):
        for units, (predicted, moment, measured) in zip(FINAL_REDUCE_PLANS, rank):
            assert moment == "the end of the backward", (units, moment)
            assert abs(measured - predicted) <= 1024, (units, measured, predicted)


# bf16 plans against PyTorch's tracker: (style, units as path -> (mode, checkpoint))
BF16_PLANS = (
    # every unit replicated, on FSDP2 with a shard group of one: a reduce-scatter input kept as a sharded unit's
    ("recurrent", {"gru": ("replicate", True), "rnn": ("replicate", False), "": ("replicate", False)}),
    ("recurrent", {"gru": ("replicate", False), "rnn": ("replicate", False), "": ("replicate", False)}),
    # every unit sharded: gloo's reduce-scatter copies its fp32 input, twice the bf16 gradients freed before it
    ("task_heads", {"trunk": ("zero3", False), "mid": ("zero3", False), "": ("zero3", False)}),
    ("gru_attention", {"encoder": ("zero3", False), "decoder": ("zero3", False), "": ("zero3", False)}),
    ("gru_attention", {"encoder": ("replicate", False), "decoder": ("zero2", True), "": ("replicate", False)}),
    # the root's RMSNorm (computed in fp32) runs its backward between two units': one's reduce-scatter input kept,
    # the next one's parameters prefetched
    ("padded", {"emb": ("zero2", False), "attn": ("zero3", False), "ff": ("replicate", False),
                "cls": ("replicate", False), "": ("zero3", False)}),
)


def _bf16_peaks(rank, world_size, plans=BF16_PLANS, collectives_impl="native"):
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.distributed import collectives
    from osdp.planner import planning_description
    from osdp.schema.plan import Plan, UnitPlan

    collectives.set_reduce_scatter(collectives_impl)
    collectives.set_all_gather(collectives_impl)
    machine = calibrate()
    out, descriptions = [], {}
    for style, units in plans:
        steps = styles.batches(style, 2 * ROWS, STEPS)
        if style not in descriptions:
            example = styles.inputs_of(style, tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0]))
            descriptions[style] = planning_description(styles.build(style), example, loss_fn=PLANNING_LOSS[style],
                                                       mixed_precision="bf16")
        plan = Plan(units=[UnitPlan(p, mode=m, checkpoint=c) for p, (m, c) in units.items()], batch_size=ROWS,
                    world_size=world_size, mixed_precision="bf16")
        predicted = predict(descriptions[style], plan, machine.device_info, optimizer="sgd-momentum",
                            calibration=machine.calibration).peak_bytes
        model = styles.build(style)
        osdp.wrap(model, plan=plan)
        _, peaks = _train(model, style, steps, rank, world_size, measure=True)
        out.append((predicted, max(peaks)))
    return out


def test_bf16_plans_are_priced_with_what_fsdp2_and_gloo_hold_as_they_reduce():
    """A replicated unit in bf16 runs on FSDP2 with a shard group of one, and FSDP2 keeps its reduce-scatter input
    (its whole gradient, in fp32) until the next unit reduces, as a sharded unit's; and on CPU osdp's reduce-scatter
    is gloo's all-reduce of a copy of that fp32 input, alive after FSDP2 freed the bf16 gradients (in fp32 the two
    are as large). And a root's working set in between two units' backwards meets what FSDP2 holds there. Priced
    without them, these plans measured 24,312 B (4%), 13,688 B, 136,060 B (10%), 181,294 B (15%), 106,694 B (8%)
    and 11,494 B (6%) over their predictions."""
    for rank in run_ranks(_bf16_peaks, 2, timeout=400):
        for (style, units), (predicted, measured) in zip(BF16_PLANS, rank):
            assert measured <= predicted <= 1.10 * measured, (style, units, measured, predicted)


def test_a_pairwise_reduce_scatter_is_priced_with_its_own_buffers_not_the_native_ones_copy():
    """osdp's pairwise reduce-scatter receives N-2 chunks into buffers of its own (none on 2 ranks) where the
    native one all-reduces a copy of its whole input. Priced with that copy, the bf16 plan sharding every unit of
    the task-heads model measured 12% under its prediction with the pairwise one. Both collectives pairwise, as
    the sweeps' loopback link runs them (and as the sweep's test calibrates them: one calibration for both)."""
    plans = [plan for plan in BF16_PLANS if plan[0] == "task_heads"]
    for rank in run_ranks(_bf16_peaks, 2, plans, "pairwise", timeout=300):
        for (style, units), (predicted, measured) in zip(plans, rank):
            assert measured <= predicted <= 1.03 * measured, (style, units, measured, predicted)


def _split_head_peaks(rank, world_size):
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_description
    from osdp.schema.plan import Plan, UnitPlan

    steps = styles.batches("shared_layer", 2 * ROWS, STEPS)
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in steps[0])
    machine = calibrate()
    description = planning_description(styles.build("shared_layer"), example, loss_fn=PLANNING_LOSS["shared_layer"])
    plan = Plan(units=[UnitPlan("emb", "zero2", checkpoint=True), UnitPlan("head", "zero3", split=2),
                       UnitPlan("proj", "replicate"), UnitPlan("", "zero3")], batch_size=ROWS, world_size=world_size)
    prediction = predict(description, plan, machine.device_info, optimizer="sgd-momentum",
                         calibration=machine.calibration)
    model = styles.build("shared_layer")
    osdp.wrap(model, plan=plan)
    _, peaks = _train(model, "shared_layer", steps, rank, world_size, measure=True)
    head = next(u for u in description.units if u.path == "head")
    return prediction.peak_bytes, max(peaks), head.costs["fp32"].split_rows(ROWS), example[0].numel()


def test_a_split_linear_is_priced_with_its_slices_of_the_output_and_of_its_gradient():
    """The split loop makes each slice's product before copying it into the output, and copies each slice of the
    output gradient out of the whole: rows x every rank's slice columns, for as many rows as the Linear's input
    has (the describe records them). Without them the ALBERT-like model with its head split in two measured
    1,008 B over its prediction (the head's backward 12.5 KB over, masked by the root's working set)."""
    for predicted, measured, rows, tokens in run_ranks(_split_head_peaks, 2, timeout=300):
        assert rows == tokens  # the head runs on every token of the micro-batch
        assert measured <= predicted <= 1.02 * measured, (measured, predicted)


class _GainedBlocks(torch.nn.Module):
    """MLP blocks scaled by per-layer gains kept in a ParameterList on the root, with biases in a
    ParameterDict there (as layer-scale and adapter code keeps them)."""

    def __init__(self, h=32, layers=3):
        super().__init__()
        self.emb = torch.nn.Embedding(50, h)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))
            for _ in range(layers))
        self.gains = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(h)) for _ in range(layers)])
        self.extra = torch.nn.ParameterDict({"pre": torch.nn.Parameter(torch.zeros(h)),
                                             "post": torch.nn.Parameter(torch.zeros(h))})
        self.head = torch.nn.Linear(h, 50)

    def forward(self, x, y):
        h = self.emb(x) + self.extra["pre"]
        for gain, block in zip(self.gains, self.blocks):
            h = h + gain * block(h)
        logits = self.head(h + self.extra["post"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class _LargeThenSmall(torch.nn.Module):
    """An embedding, an MLP four times its size, a small head: the MLP's all-gather output is still alive as the
    head gathers."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = torch.nn.Embedding(50, h)
        self.body = torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))
        self.head = torch.nn.Linear(h, 50)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.body(self.emb(x))).flatten(0, 1), y.flatten())


def _predicted_and_measured(rank, world_size, build, units):
    """The peak of the plan of ``units`` ((path, mode, checkpoint)) as ``osdp.wrap`` would price it, the moment it
    puts it at, and the peak measured over two steps after two."""
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import planning_description
    from osdp.runtime.step import peaks_per_step
    from osdp.schema.plan import Plan, UnitPlan

    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, 50, (2 * ROWS, 6), generator=g) for _ in range(2))
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in batch)
    torch.manual_seed(0)
    description = planning_description(build(), example, loss_fn=lambda out: out, granularity="sub-block")
    plan = Plan(units=[UnitPlan(path, mode, checkpoint=checkpoint) for path, mode, checkpoint in units],
                batch_size=ROWS, world_size=world_size)
    prediction = predict(description, plan, calibrate().device_info, optimizer="sgd-momentum")
    torch.manual_seed(0)
    model = osdp.wrap(build(), plan=plan)
    peaks = peaks_per_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), example, steps=2)
    return prediction.peak_bytes, prediction.breakdown["peak_moment"], max(peaks)


def _selective_unit_peaks(rank, world_size):
    units = [("blocks.0", "zero3", True), ("blocks.1", "zero3", "selective"), ("blocks.2", "zero3", True),
             ("emb", "zero3", False), ("head", "zero3", False), ("", "zero3", False)]
    return _predicted_and_measured(rank, world_size, _GainedBlocks, units)


def test_a_selective_units_backward_is_priced_with_its_kept_outputs_freed_as_they_are_read():
    """Selective checkpointing's kept outputs, read again by a second backward through a retained graph, were kept
    to the end of every backward of their region: the selective unit's backward, the peak here, measured 2,432 B
    over its prediction. A backward that keeps no graph frees each as its recompute reads it, as torch does."""
    for predicted, moment, measured in run_ranks(_selective_unit_peaks, 2, timeout=300):
        assert moment == "backward of blocks.1", moment
        assert measured <= predicted <= 1.02 * measured, (measured, predicted)


def _gather_after_a_larger_one_peaks(rank, world_size):
    units = [("emb", "zero2", False), ("body", "zero2", False), ("head", "zero2", False), ("", "zero2", False)]
    return _predicted_and_measured(rank, world_size, _LargeThenSmall, units)


def test_a_gather_is_priced_beside_the_larger_output_the_last_one_left():
    """FSDP2 frees a unit's all-gather output once the next unit's parameters are copied out of theirs: as the
    small head gathers, the MLP's output, the head's and its parameters are alive at once, with every unit's
    parameters gathered under zero2. Priced as though the last output were gone, the plan measured 5,592 B
    (5.8%) over its prediction."""
    for predicted, moment, measured in run_ranks(_gather_after_a_larger_one_peaks, 2, timeout=300):
        assert moment == "the gather of head", moment
        assert measured <= predicted <= 1.03 * measured, (measured, predicted)
