"""Hugging Face ``transformers.Trainer`` and ``accelerate.Accelerator`` over a model wrapped by ``osdp.wrap``.

A wrapped model is already data parallel: every unit is FSDP2's (``fully_shard``), replicated units
all-reduce their gradients through osdp's reducer. Left to themselves, accelerate and the Trainer
wrap it once more: on CPU (``MULTI_CPU``) and on GPUs (``MULTI_GPU``) in
``DistributedDataParallel``, which all-reduces every gradient a second time under a ``ddp`` plan
and fails on the DTensor parameters of a sharded one (``c10d.broadcast_`` has no sharding
strategy); an FSDP2 configuration (``fsdp_version: 2``) passes a ``fully_shard``-ed model through,
but accelerate applies it on GPUs only and drops it silently on CPU. So the integration is one line:

* Trainer: ``from osdp.integrations.hf import Trainer`` in place of ``transformers.Trainer`` (same
  arguments); or :class:`OSDPTrainerMixin` before any Trainer subclass
  (``class SFT(OSDPTrainerMixin, trl.SFTTrainer)``);
* accelerate loop: ``model, opt, dl = osdp.integrations.hf.prepare(accelerator, model, opt, dl)``
  in place of ``accelerator.prepare(model, opt, dl)``.

Either checks the setup on every rank, before any step (:func:`check_accelerator`), and hands the
model to accelerate as already prepared (``_is_accelerate_prepared``, accelerate's guard against
wrapping a model twice), so no second wrapper is made and each gradient is reduced once. The model
gets a ``no_sync()`` context (what accelerate's ``no_sync``/``accumulate`` and the Trainer's gradient
accumulation call on a data-parallel model): ``set_requires_gradient_sync(False)`` for its duration,
so accumulated micro-batches communicate once, on the last.

The Trainer also clips with :func:`osdp.clip_grad_norm_` (``max_grad_norm``: the norm one process
would compute, under every plan), saves checkpoints with :mod:`osdp.runtime.dcp` (model and
optimizer with torch.distributed.checkpoint in ``checkpoint-N/osdp``, every rank its shards; the
whole model for ``from_pretrained`` beside it, from rank 0) and resumes from them
(``train(resume_from_checkpoint=...)``, under the same or another plan or number of ranks).

Refused, with the same error on every rank before any step: a model that osdp did not wrap, or that
the user wrapped again (``DistributedDataParallel``, FSDP1); a Trainer or Accelerator configured for
FSDP1 or DeepSpeed, or for mixed precision (``fp16``/``bf16``: the plan owns precision,
``osdp.wrap(..., mixed_precision="bf16")``); a plan made for another world size; ``save_on_each_node``.
In an accelerate loop, clip with ``osdp.clip_grad_norm_(model, max_norm)`` and checkpoint with
``osdp.runtime.dcp.save``/``load`` (``accelerator.save_state`` saves one rank's shards only).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from osdp.distributed import raise_on_any_rank
from osdp.fsdp_ext.apply import plan_of
from osdp.fsdp_ext.gradients import clip_grad_norm_
from osdp.integrations import IntegrationError
from osdp.runtime import dcp as osdp_checkpoint

CHECKPOINT_SUBDIR = "osdp"  # inside the Trainer's checkpoint-N: the model's and the optimizer's shards (DCP)
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's name, so that the Trainer's own files sit beside ours


def _is_osdp(module: nn.Module) -> bool:
    try:
        plan_of(module)
    except ValueError:
        return False
    return True


def _wrapper_around_osdp(model: nn.Module) -> str | None:
    """The name of a wrapper the user put around an osdp-wrapped model (None if none)."""
    inner, outer = model, None
    for _ in range(8):  # DistributedDataParallel, FSDP1, torch.compile: each keeps the wrapped module as an attribute
        nested = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if not isinstance(nested, nn.Module):
            break
        outer = outer or type(inner).__name__
        inner = nested
        if _is_osdp(inner):
            return outer
    return None


def model_problem(model: nn.Module, world_size: int) -> str | None:
    """Why ``model`` cannot be trained as an osdp model on ``world_size`` ranks (None: it can)."""
    wrapper = _wrapper_around_osdp(model)
    if wrapper is not None and wrapper != "OptimizedModule":
        return (f"the model was wrapped by osdp.wrap and then in {wrapper}: osdp already makes it data parallel, "
                f"and a second wrapper would reduce every gradient twice (or fail on sharded parameters); pass the "
                f"model that osdp.wrap returned, without {wrapper}")
    if wrapper == "OptimizedModule":
        return ("the model was compiled after osdp.wrap (torch.compile(model)); compile its units instead "
                "(osdp.compile_units(model)) and pass the osdp-wrapped model")
    if not _is_osdp(model):
        return ("the model has not been wrapped by osdp.wrap: wrap it first (osdp.wrap(model, ...)), or use "
                "transformers.Trainer / accelerator.prepare without osdp.integrations")
    plan = plan_of(model)
    if plan.world_size is not None and plan.world_size != world_size:
        return (f"the osdp plan was made for world size {plan.world_size} but the Trainer/Accelerator runs "
                f"{world_size} processes; re-plan for {world_size} ranks")
    if dist.is_initialized() and dist.get_world_size() != world_size:
        return (f"the model was wrapped on a process group of {dist.get_world_size()} ranks but the "
                f"Trainer/Accelerator runs {world_size} processes")
    return None


_FSDP1 = ("the Trainer/Accelerator is configured for FSDP1 (fsdp_version 1), which would wrap the osdp model in "
          "FullyShardedDataParallel; osdp already shards it with FSDP2: remove fsdp/fsdp_config (TrainingArguments) "
          "or the FullyShardedDataParallelPlugin")


def accelerator_problem(accelerator: Any) -> str | None:
    """Why ``accelerator`` cannot train an osdp model (None: it can)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    kind = state.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return ("the Trainer/Accelerator is configured for DeepSpeed, which would wrap the osdp model again; "
                "osdp already shards it: remove the deepspeed configuration")
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    if fsdp_plugin is not None and getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        return _FSDP1
    if accelerator.mixed_precision not in (None, "no"):
        return (f"the Trainer/Accelerator asks for mixed precision '{accelerator.mixed_precision}' (fp16/bf16); "
                "an osdp plan owns precision: wrap with osdp.wrap(..., mixed_precision='bf16') and leave "
                "fp16/bf16 off")
    return None


def check_accelerator(accelerator: Any, model: nn.Module, extra_problem: str | None = None) -> None:
    """Raise :class:`IntegrationError` on every rank unless ``accelerator`` can train the osdp ``model``.

    Collective when a process group exists: every rank calls it, and a problem found on any rank
    is raised on all, before any training step (so that none waits in a collective).
    """
    problem = extra_problem or accelerator_problem(accelerator) or model_problem(model, accelerator.num_processes)
    raise_on_any_rank(None if problem is None else IntegrationError(f"osdp.integrations.hf: {problem}"))


def pass_through(model: nn.Module) -> nn.Module:
    """Mark the osdp ``model`` so that ``accelerator.prepare`` returns it as it is, and give it ``no_sync()``.

    ``_is_accelerate_prepared`` is accelerate's own mark of a model it has prepared (it never wraps such
    a model again); ``no_sync`` is the context that accelerate and the Trainer enter around micro-batches
    whose gradients are accumulated without communication.
    """
    model._is_accelerate_prepared = True

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    model.no_sync = no_sync
    return model


def prepare(accelerator: Any, model: nn.Module, *objects: Any) -> Any:
    """``accelerator.prepare(model, *objects)`` for a model wrapped by ``osdp.wrap``. Collective.

    The model is checked (:func:`check_accelerator`) and returned as it is; optimizers, data loaders
    and schedulers are prepared by accelerate as usual (a data loader is sharded over the ranks).
    """
    check_accelerator(accelerator, model)
    pass_through(model)
    return accelerator.prepare(model, *objects)


def _raw_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the torch one


class OSDPTrainerMixin:
    """Put before a ``transformers.Trainer`` (sub)class to train a model wrapped by ``osdp.wrap``.

    See the module docstring: the model is checked on every rank when the Trainer is built, and is not
    wrapped again; gradient accumulation, ``max_grad_norm``, checkpoint saving and resuming follow osdp.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        # FSDP1 first: on a machine without accelerators accelerate's FSDP plugin fails while the Trainer is built
        fsdp_version = (getattr(training_args, "fsdp_plugin_args", None) or {}).get("fsdp_version", 1)
        fsdp1 = training_args is not None and bool(training_args.fsdp) and fsdp_version != 2
        raise_on_any_rank(IntegrationError(f"osdp.integrations.hf: {_FSDP1}") if fsdp1 else None)
        super().__init__(*args, **kwargs)
        problem = None
        if self.args.save_on_each_node and self.args.save_strategy != "no":
            problem = ("save_on_each_node is not supported: osdp checkpoints are written once, every rank its "
                       "shards, to a file system that every rank sees")
        check_accelerator(self.accelerator, self.model, problem)
        pass_through(self.model)

    # -- clipping: the norm of all gradients, whatever form each unit's take -----------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(model, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- checkpoints -----------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The whole model, gathered to rank 0, written there with ``save_pretrained``. Collective."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = osdp_checkpoint.full_state_dict(self.model)  # every rank takes part; rank 0 holds it
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        osdp_checkpoint.save(Path(output_dir) / CHECKPOINT_SUBDIR, self.model, _raw_optimizer(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # The model is loaded with the optimizer (_load_optimizer_and_scheduler), from the same DCP checkpoint.
        present = (Path(resume_from_checkpoint) / CHECKPOINT_SUBDIR).is_dir()
        problem = None if present else (
            f"{resume_from_checkpoint} holds no osdp checkpoint ({CHECKPOINT_SUBDIR}/): resume from a checkpoint "
            "that osdp.integrations.hf.Trainer saved")
        raise_on_any_rank(None if problem is None else IntegrationError(f"osdp.integrations.hf: {problem}"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        osdp_checkpoint.load(Path(checkpoint) / CHECKPOINT_SUBDIR, self.model, _raw_optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class Trainer(OSDPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a model wrapped by ``osdp.wrap`` (see :class:`OSDPTrainerMixin`)."""


__all__ = ["IntegrationError", "OSDPTrainerMixin", "Trainer", "accelerator_problem", "check_accelerator",
           "model_problem", "pass_through", "prepare"]
