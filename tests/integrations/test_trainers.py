"""Hugging Face's Trainer and accelerate over an osdp-wrapped model (osdp.integrations.hf), on 2 gloo ranks.

A tiny GPT-2 built from a config (no download, dropout off) is wrapped under a ddp, a zero2, an fsdp, a
mixed plan and one searched at a budget (no split plan: GPT-2's projections are Conv1D, which osdp does not
split, and its head is tied) and trained by ``osdp.integrations.hf.Trainer`` for a few steps (clipping on, with and
without gradient accumulation, a checkpoint saved and resumed); losses and final parameters equal, within
1e-5, a plain ``transformers.Trainer`` run in one process on the global batch. A plain accelerate loop
(``osdp.integrations.hf.prepare``) trains the same. Setups that cannot work fail on every rank, before
any step, with an error that names the problem.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dist_harness import run_ranks  # noqa: E402
from training_check import full_state, plan_kinds  # noqa: E402

import osdp  # noqa: E402
from osdp.runtime.dcp import MARKER
from osdp.schema.plan import Plan

WORLD = 2
PER_RANK = 2
STEPS = 3
ATOL = 1e-5
VOCAB, SEQ = 128, 8


def build():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def dataset(n):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def arguments(output_dir, per_device, steps=STEPS, accumulate=1, **overrides):
    settings = dict(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulate, max_steps=steps,
        optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.5,
        train_sampling_strategy="sequential", save_strategy="no", logging_steps=1, seed=0,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def plans():
    return plan_kinds(build())  # the mixed plan checkpoints the root: the Trainer reads its forward's signature


SEARCHED = "searched"  # osdp.wrap(device_mem=...) halfway between the least budget and the fastest plan's


def _wrap(model, how):
    if how != SEARCHED:
        osdp.wrap(model, plan=how)
        return
    example = {k: torch.stack([row[k] for row in dataset(PER_RANK)]) for k in ("input_ids", "labels")}
    try:
        osdp.wrap(build(), device_mem=1024, example_input=example, loss_fn=lambda out: out.loss)
    except osdp.BudgetTooSmall as e:
        least = e.min_peak_bytes
    probe = build()
    osdp.wrap(probe, device_mem="64GiB", example_input=example, loss_fn=lambda out: out.loss)
    most = osdp.plan_of(probe).predicted_peak_bytes
    osdp.wrap(model, device_mem=(least + most) // 2, example_input=example, loss_fn=lambda out: out.loss)


def _rank_environment(rank, world_size):
    """What torchrun sets, from which accelerate and the Trainer read their distributed setup."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _reference(rank, world_size, output_dir, steps, accumulate):
    _rank_environment(rank, world_size)
    model = build()
    trainer = transformers.Trainer(model=model, args=arguments(output_dir, WORLD * PER_RANK, steps, accumulate),
                                   train_dataset=dataset(WORLD * PER_RANK * steps * accumulate))
    trainer.train()
    return _losses(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(tmp_path, steps=STEPS, accumulate=1):
    """A plain transformers.Trainer in one process (a process of its own) on the global batch."""
    return run_ranks(_reference, 1, str(tmp_path / "ref"), steps, accumulate, timeout=120)[0]


def _compare(name, got, ref):
    (losses, state), (ref_losses, ref_state) = got, ref
    assert len(losses) == len(ref_losses), (name, losses, ref_losses)
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert set(state) == set(ref_state), f"{name}: state dict keys differ"
    param_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert loss_err <= ATOL and param_err <= ATOL, \
        f"{name}: loss differs by {loss_err:.1e}, parameters by {param_err:.1e}"


# -- Trainer under every kind of plan ---------------------------------------------------------------------------


def _all_reduced_bytes_during(run) -> int:
    """Bytes ``torch.distributed.all_reduce`` reduced while ``run()`` ran (osdp's reducer calls it; a second
    DistributedDataParallel would add its own C++ all-reduces of every gradient, and fail the next check)."""
    import torch.distributed as dist

    real, total = dist.all_reduce, [0]

    def counting(tensor, *args, **kwargs):
        total[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        run()
    finally:
        dist.all_reduce = real
    return total[0]


def _train_with_trainer(rank, world_size, plan_jsons, output_dir, accumulate):
    from osdp.integrations.hf import Trainer

    _rank_environment(rank, world_size)
    out = {}
    for name, plan_json in plan_jsons.items():
        model = build()
        _wrap(model, plan_json)
        trainer = Trainer(model=model, args=arguments(f"{output_dir}/{name}", PER_RANK, accumulate=accumulate),
                          train_dataset=dataset(world_size * PER_RANK * STEPS * accumulate))
        reduced = _all_reduced_bytes_during(trainer.train)
        if name == "ddp":  # every gradient byte all-reduced once per step (and its reducer's flag), not twice
            params = list(model.parameters())
            per_step = sum(p.numel() * p.element_size() for p in params) + 4 * len(params)
            assert per_step * STEPS <= reduced < 2 * per_step * STEPS, (reduced, per_step * STEPS)
        wrapped = trainer.model_wrapped
        assert wrapped is model, f"{name}: the Trainer wrapped the model again, in {type(wrapped).__name__}"
        osdp.check_replicas(model)
        state = full_state(model)
        out[name] = (_losses(trainer), state if rank == 0 else None)
    return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_trains_every_plan_as_one_process(tmp_path, accumulate):
    chosen = {n: p.to_json() for n, p in plans().items()}
    if accumulate > 1:
        chosen = {n: chosen[n] for n in ("ddp", "mixed")}
    else:
        chosen[SEARCHED] = SEARCHED
    got = run_ranks(_train_with_trainer, WORLD, chosen, str(tmp_path), accumulate, timeout=240)
    ref = reference(tmp_path, accumulate=accumulate)
    for name in chosen:
        _compare(name, got[0][name], ref)


# -- checkpoints: saved by one Trainer, resumed by another ------------------------------------------------------


def _save_and_resume(rank, world_size, plan_json, output_dir):
    """Four steps saving a checkpoint after two; then a fresh model, other weights, resumed from it."""
    from osdp.integrations.hf import Trainer

    _rank_environment(rank, world_size)
    data = dataset(world_size * PER_RANK * 4)
    adam = dict(optim="adamw_torch", learning_rate=1e-2)  # optimizer state that resuming must restore
    model = build()
    osdp.wrap(model, plan=plan_json)
    whole = Trainer(model=model, train_dataset=data,
                    args=arguments(output_dir, PER_RANK, steps=4, save_strategy="steps", save_steps=2, **adam))
    whole.train()
    whole_state = full_state(model)
    model = build()
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    osdp.wrap(model, plan=plan_json)
    resumed = Trainer(model=model, args=arguments(output_dir, PER_RANK, steps=4, **adam), train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")
    osdp.check_replicas(model)
    resumed_state = full_state(model)
    # the resumed log starts with the checkpoint's (steps 1-2), then its own steps
    if rank != 0:
        whole_state = resumed_state = None
    return _losses(whole)[2:], _losses(resumed)[2:], whole_state, resumed_state


def test_trainer_saves_and_resumes_a_checkpoint(tmp_path):
    plan = plans()["mixed"]
    whole_losses, resumed_losses, whole_state, resumed_state = run_ranks(
        _save_and_resume, WORLD, plan.to_json(), str(tmp_path / "run"), timeout=240)[0]
    _compare("resumed", (resumed_losses, resumed_state), (whole_losses, whole_state))
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-2")  # whole, from rank 0
    assert saved.lm_head.weight.data_ptr() == saved.transformer.wte.weight.data_ptr()
    assert (tmp_path / "run" / "checkpoint-2" / "osdp" / MARKER).is_file()


# -- a plain accelerate loop ------------------------------------------------------------------------------------


def _accelerate_loop(rank, world_size, plan_json, accumulate):
    from accelerate import Accelerator

    from osdp.integrations.hf import prepare

    _rank_environment(rank, world_size)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = build()
    osdp.wrap(model, plan=plan_json)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(dataset(world_size * PER_RANK * STEPS * accumulate), batch_size=PER_RANK)
    model, optimizer, data = prepare(accelerator, model, optimizer, data)
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    losses = []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                osdp.clip_grad_norm_(model, 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    osdp.check_replicas(model)
    state = full_state(model)  # collective
    return losses, state if rank == 0 else None


def test_accelerate_loop_trains_as_one_process():
    plan = plans()["mixed"]
    accumulate = 2
    got = run_ranks(_accelerate_loop, WORLD, plan.to_json(), accumulate, timeout=240)
    # one process: the same loop on the global batch, plain torch
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = dataset(WORLD * PER_RANK * STEPS * accumulate)
    micro = [data[i:i + WORLD * PER_RANK] for i in range(0, len(data), WORLD * PER_RANK)]
    ref_losses = []
    for i, samples in enumerate(micro):
        batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        loss = model(**batch).loss
        (loss / accumulate).backward()
        ref_losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    ref_state = model.state_dict()
    losses = [sum(r[0][i] for r in got) / WORLD for i in range(len(micro))]
    _compare("accelerate", (losses, got[0][1]), (ref_losses, ref_state))


# -- setups that cannot work: the same clear error on every rank, before any step --------------------------------


def _bad_setup(rank, world_size, case):
    import transformers

    from osdp.fsdp_ext.module_api import WrappedTwiceError
    from osdp.integrations.hf import IntegrationError, Trainer

    _rank_environment(rank, world_size)
    model = build()
    overrides = {}
    if case == "other_world_size":
        paths = [u.path for u in osdp.discover_units(model)]
        plan = Plan.for_strategy(paths, "fsdp")
        osdp.wrap(model, plan=plan)
        plan.world_size = 4  # as if planned for 4 ranks (osdp.wrap itself refuses such a plan)
    elif case != "not_wrapped":
        osdp.wrap(model, strategy="ddp")
    if case == "fsdp1":
        overrides = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 1})
    trainer = transformers.Trainer if case == "plain_trainer" else Trainer
    try:
        if case == "ddp_on_top":  # the user's own DistributedDataParallel around the wrapped model
            model = torch.nn.parallel.DistributedDataParallel(model)
        trainer(model=model, args=arguments(f"/tmp/unused-{case}", PER_RANK, **overrides),
                train_dataset=dataset(8)).train()
    except (IntegrationError, WrappedTwiceError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, words", [
    ("ddp_on_top", "osdp.integrations.hf.Trainer"),
    ("plain_trainer", "osdp.integrations.hf.Trainer"),  # accelerate's DistributedDataParallel, refused the same way
    ("fsdp1", "FSDP1"),
    ("other_world_size", "world size 4"),
    ("not_wrapped", "not been wrapped by osdp.wrap"),
])
def test_setups_that_cannot_work_fail_clearly_on_every_rank(case, words):
    messages = run_ranks(_bad_setup, WORLD, case, timeout=120)
    for message in messages:
        assert message is not None and words in message, messages
