"""Lightning's Trainer over an osdp-wrapped model (osdp.integrations.lightning.OSDPStrategy), on 2 gloo ranks.

A LightningModule holding a tiny GPT (tied embeddings) calls ``osdp.wrap(self.net, plan=...)`` in
``configure_model()``, under a ddp, a zero2, an fsdp and a mixed plan, and is trained by
``Trainer(strategy=OSDPStrategy(), accelerator="cpu", devices=2)`` for a few SGD steps (clipping on, with
and without gradient accumulation; validated as Lightning does by default, a sanity check before the first
step and again at the epoch's end); the mean of the ranks' losses and the final parameters equal, within
1e-5, plain training in one process on the global batch, and the sanity check's losses the untrained model's.
(Over gloo Lightning validates under ``no_grad``, over NCCL under ``inference_mode``: that order is tested in
``tests/runtime/test_training_loop.py``.) A checkpoint saved by Lightning's
``ModelCheckpoint`` at step 2 and resumed in fresh processes (as after a kill) ends as the uninterrupted
run. Setups that cannot work fail on every rank, before any step, with an error that names the problem.

Each rank runs its own Trainer in a process of ``run_ranks`` whose process group is already
initialised: Lightning joins it (``LOCAL_RANK`` set: processes made outside Lightning) and launches none.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

L = pytest.importorskip("lightning.pytorch")

from dist_harness import run_ranks  # noqa: E402
from toy_models import GPT  # noqa: E402
from training_check import full_state, plan_kinds  # noqa: E402

import osdp  # noqa: E402
from osdp.runtime.dcp import MARKER
from osdp.schema.plan import Plan

WORLD = 2
PER_RANK = 2
STEPS = 3
ATOL = 1e-5
VOCAB, SEQ = 64, 8
CLIP = 0.5


def build():
    torch.manual_seed(0)
    return GPT(V=VOCAB, h=32, L=2, T=SEQ)


def dataset(n):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def plans():
    return plan_kinds(build())


def make_optimizer(params, adam):
    return torch.optim.AdamW(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=0.1)


class LitGPT(L.LightningModule):
    """A user's LightningModule: the network built in __init__, made data parallel by osdp in configure_model."""

    def __init__(self, plan_json=None, adam=False):
        super().__init__()
        self.net = build()
        self.plan_json, self.adam, self.losses, self.validated = plan_json, adam, [], []

    def configure_model(self):
        from osdp.integrations.lightning import osdp_roots

        if self.plan_json is not None and not osdp_roots(self):  # Lightning may call it again (fit, then test)
            osdp.wrap(self.net, plan=self.plan_json)

    def training_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.validated.append((batch, loss.item(), self.trainer.sanity_checking))
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.adam)


def _rank_environment(rank, world_size):
    """What torchrun sets; LOCAL_RANK tells Lightning that the processes were made outside it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def trainer(steps=STEPS, accumulate=1, clip=CLIP, callbacks=(), precision="32-true", sanity_steps=0):
    from osdp.integrations.lightning import OSDPStrategy

    return L.Trainer(strategy=OSDPStrategy(), accelerator="cpu", devices=WORLD, max_steps=steps,
                     accumulate_grad_batches=accumulate, gradient_clip_val=clip, precision=precision,
                     callbacks=list(callbacks), enable_checkpointing=bool(callbacks), logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity_steps)


def loader(n):
    return DataLoader(dataset(n), batch_size=PER_RANK)  # Lightning shards it (a DistributedSampler of its own)


class ResumableBatches:
    """This rank's batches (every WORLD-th sample, in order) that Lightning saves and restores the position of.

    Resumed mid-epoch from a plain DataLoader, Lightning starts the epoch's data again; from an iterable with
    ``state_dict``/``load_state_dict`` it goes on where the checkpoint was taken.
    """

    def __init__(self, data, rank, world_size):
        self.mine = [data[i] for i in range(rank, len(data), world_size)]
        self.done = 0

    def __len__(self):
        return len(self.mine) // PER_RANK

    def __iter__(self):
        for b in range(self.done, len(self)):
            self.done = b + 1  # handed out; what Lightning saves when batch b is its last step's
            rows = self.mine[b * PER_RANK:(b + 1) * PER_RANK]
            yield tuple(torch.stack(column) for column in zip(*rows))
        self.done = 0

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


def mean_losses(losses):
    """Every rank's loss of each step, averaged: the loss of the global batch."""
    t = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / torch.distributed.get_world_size()).tolist()


def reference(steps=STEPS, accumulate=1, clip=CLIP):
    """Plain training in one process on the global batch (WORLD * PER_RANK samples a micro-batch)."""
    model = build()
    opt = make_optimizer(model.parameters(), adam=False)
    data = dataset(WORLD * PER_RANK * steps * accumulate)
    # Lightning shards a training set with a DistributedSampler that shuffles (seed 0, epoch 0): the global
    # micro-batch i is every rank's i-th batch of PER_RANK samples from it
    ranks = [list(DistributedSampler(data, WORLD, r, shuffle=True, seed=0)) for r in range(WORLD)]
    batches = [data[[i for idx in ranks for i in idx[b * PER_RANK:(b + 1) * PER_RANK]]]
               for b in range(steps * accumulate)]
    losses = []
    for step in range(steps):
        micro = batches[step * accumulate:(step + 1) * accumulate]
        for x, y in micro:
            loss = model(x, y)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(name, got, ref):
    (losses, state), (ref_losses, ref_state) = got, ref
    assert len(losses) == len(ref_losses), (name, losses, ref_losses)
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert set(state) == set(ref_state), f"{name}: state dict keys differ: {sorted(set(state) ^ set(ref_state))}"
    param_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert loss_err <= ATOL and param_err <= ATOL, \
        f"{name}: loss differs by {loss_err:.1e}, parameters by {param_err:.1e}"


def _net_state(module):
    return full_state(module.net)  # collective


# -- every kind of plan -----------------------------------------------------------------------------------------


def _train(rank, world_size, plan_jsons, accumulate):
    from osdp.integrations.lightning import OSDPStrategy

    _rank_environment(rank, world_size)
    out = {}
    for name, plan_json in plan_jsons.items():
        module = LitGPT(plan_json)
        if accumulate == 1:
            # with validation as Lightning runs it by default: a sanity check in inference mode before any
            # training step, and again at the epoch's end
            t = trainer(sanity_steps=2)
            t.fit(module, loader(world_size * PER_RANK * STEPS), loader(world_size * PER_RANK * 2))
            sanity = [(batch, loss) for batch, loss, checking in module.validated if checking]
            assert len(sanity) == 2 and len(module.validated) == 4, (name, len(module.validated))
            untrained = build()
            for batch, loss in sanity:  # this rank's batches, through the untrained model in one process
                assert abs(untrained(*batch).item() - loss) <= ATOL, (name, loss)
        else:
            t = trainer(accumulate=accumulate)
            t.fit(module, loader(world_size * PER_RANK * STEPS * accumulate))
        assert isinstance(t.strategy, OSDPStrategy) and t.strategy.launcher is None, "Lightning launched processes"
        assert t.global_step == STEPS, (name, t.global_step)
        assert not isinstance(t.strategy.model, torch.nn.parallel.DistributedDataParallel)
        osdp.check_replicas(module.net)
        state = _net_state(module)
        out[name] = (mean_losses(module.losses), state if rank == 0 else None)
    return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_trains_every_plan_as_one_process(accumulate):
    chosen = {n: p.to_json() for n, p in plans().items()}
    if accumulate > 1:
        chosen = {n: chosen[n] for n in ("ddp", "mixed")}
    got = run_ranks(_train, WORLD, chosen, accumulate, timeout=240)[0]
    ref = reference(accumulate=accumulate)
    for name in chosen:
        _compare(name, got[name], ref)


# -- checkpoints: saved by Lightning's ModelCheckpoint, resumed in fresh processes -------------------------------


def _run_with_checkpoints(rank, world_size, plan_json, directory, resume_from):
    """Four AdamW steps saving after 2 and 4; or, with ``resume_from``, other weights resumed from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _rank_environment(rank, world_size)
    module = LitGPT(plan_json, adam=True)
    if resume_from is not None:
        torch.manual_seed(123)
        with torch.no_grad():
            for p in module.net.parameters():
                p.normal_()
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    t = trainer(steps=4, callbacks=[saver])
    t.fit(module, ResumableBatches(dataset(world_size * PER_RANK * 4), rank, world_size), ckpt_path=resume_from)
    assert t.global_step == 4, t.global_step
    osdp.check_replicas(module.net)
    state = _net_state(module)
    return mean_losses(module.losses)[-2:], state if rank == 0 else None  # resumed: steps 3-4 only


def test_checkpoint_saved_and_resumed_in_fresh_processes(tmp_path):
    plan = plans()["mixed"].to_json()
    whole = run_ranks(_run_with_checkpoints, WORLD, plan, str(tmp_path), None, timeout=180)[0]
    saved = tmp_path / "step=2.ckpt"
    assert (saved / MARKER).is_file() and (saved / "meta.pt").is_file()
    resumed = run_ranks(_run_with_checkpoints, WORLD, plan, str(tmp_path / "again"), str(saved), timeout=180)[0]
    _compare("resumed", resumed, whole)


# -- refused setups -------------------------------------------------------------------------------------------


def _refused(rank, world_size, case):
    from osdp.integrations.lightning import IntegrationError

    _rank_environment(rank, world_size)
    plan = Plan.for_strategy([u.path for u in osdp.discover_units(build())], "fsdp").to_json()
    module = LitGPT(None if case == "unwrapped" else plan)
    t = trainer(precision="bf16-true" if case == "precision" else "32-true")
    try:
        t.fit(module, loader(world_size * PER_RANK * STEPS))
    except IntegrationError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, words", [("unwrapped", "osdp.wrap"), ("precision", "owns precision")])
def test_refused_on_every_rank_before_any_step(case, words):
    messages = run_ranks(_refused, WORLD, case, timeout=120)
    assert all(m is not None and words in m for m in messages), messages
