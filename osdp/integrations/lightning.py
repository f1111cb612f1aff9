"""Lightning (``lightning.pytorch``) over a model wrapped by ``osdp.wrap`` in ``configure_model()``.

Lightning's strategy for a model that applies its own parallelism is ``ModelParallelStrategy``: it
starts (or joins) the process group, builds a device mesh, calls the LightningModule's
``configure_model()`` (where the model parallelises itself, FSDP2's ``fully_shard`` in Lightning's
examples) and then neither wraps the model again nor moves its data parallelism elsewhere. It runs on
CPU with gloo as well as on GPUs. As it is, it does not fit an osdp model in four places, which
:class:`OSDPStrategy` (a subclass) changes:

* its mesh defaults to tensor parallelism within a node (``tensor_parallel_size`` = devices per
  node), so every rank of one node would be given the same data; osdp is data parallel over every
  rank: here ``data_parallel_size`` is the world size;
* its checkpoints (``torch.distributed.checkpoint``) are loaded only into a model with DTensor
  parameters, so a ``ddp`` plan (plain, replicated tensors) cannot resume; here the model and the
  optimizer are saved and loaded with :mod:`osdp.runtime.dcp` (DCP, every rank its shards, resharded
  on load to another plan or number of ranks) and Lightning's own state (loops, callbacks, schedulers,
  hyper-parameters) beside them, in ``meta.pt``, from rank 0: a checkpoint ``*.ckpt`` is a directory;
* gradient clipping (``Trainer(gradient_clip_val=...)``) uses ``torch.nn.utils.clip_grad_norm_``,
  which does not take a mix of sharded and replicated gradients; here :func:`osdp.clip_grad_norm_`
  (the norm one process would compute, under every plan);
* gradient accumulation (``accumulate_grad_batches``) reduces every micro-batch; here the gradients
  of the micro-batches before the last are kept local (``set_requires_gradient_sync(False)``).

The user's line::

    trainer = lightning.pytorch.Trainer(strategy=osdp.integrations.lightning.OSDPStrategy(),
                                        accelerator="cpu", devices=2)   # or accelerator="gpu"

with a LightningModule whose ``configure_model()`` calls ``osdp.wrap(self.net, plan=...)`` (or
``strategy=``, or ``device_mem=`` and ``example_input=``) on the submodule(s) that hold its
parameters. Launching is Lightning's: it starts the processes itself, or joins those that
``torchrun``/SLURM started, or a process group already initialised.

Refused on every rank, before any step (:class:`IntegrationError`): a LightningModule with no
osdp-wrapped submodule after ``configure_model()``, or with trainable parameters outside every
osdp-wrapped submodule (their gradients would never be reduced); a plan made for another world size;
a precision other than ``"32-true"`` (the plan owns precision: ``osdp.wrap(..., mixed_precision=...)``);
saving a checkpoint with more than one optimizer. A model wrapped by osdp and then by
``DistributedDataParallel`` is refused by osdp itself (``WrappedTwiceError``), and FSDP1 modules by
``ModelParallelStrategy``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy

from osdp.distributed import raise_on_any_rank
from osdp.fsdp_ext.apply import plan_of
from osdp.fsdp_ext.gradients import clip_grad_norm_
from osdp.integrations import IntegrationError
from osdp.runtime import dcp as osdp_checkpoint

METADATA_NAME = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME) for the rest


def osdp_roots(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost submodules of ``module`` (itself included, name ``""``) that ``osdp.wrap`` wrapped."""
    roots: dict[str, nn.Module] = {}
    for name, sub in module.named_modules():
        if any(name == r or name.startswith(r + ".") for r in roots if r) or "" in roots:
            continue
        try:
            plan_of(sub)
        except ValueError:
            continue
        roots[name] = sub
    return roots


def module_problem(module: nn.Module, world_size: int) -> str | None:
    """Why the configured LightningModule ``module`` cannot be trained by :class:`OSDPStrategy` (None: it can)."""
    roots = osdp_roots(module)
    if not roots:
        return ("no submodule of the LightningModule was wrapped by osdp.wrap: call osdp.wrap(self.<submodule>, ...) "
                "in configure_model()")
    covered = {id(p) for root in roots.values() for p in root.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
    if outside:
        shown = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        return (f"trainable parameters outside every osdp-wrapped submodule ({shown}) would never have their "
                "gradients reduced: wrap the submodule that holds them with osdp.wrap too, or the whole "
                "network in one")
    for name, root in roots.items():
        planned = plan_of(root).world_size
        if planned is not None and planned != world_size:
            return (f"the osdp plan of '{name or '<root>'}' was made for world size {planned} but the Trainer "
                    f"runs {world_size} processes; re-plan for {world_size} ranks")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != world_size:
        return (f"the process group has {torch.distributed.get_world_size()} ranks but the Trainer runs "
                f"{world_size} processes")
    return None


class OSDPPrecision(Precision):
    """Lightning's full precision (``"32-true"``) with gradients clipped by :func:`osdp.clip_grad_norm_`."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(list(self.main_params(optimizer)), clip_val)


class OSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for a LightningModule that calls ``osdp.wrap`` in ``configure_model()``.

    See the module docstring: every rank is a data-parallel rank, checkpoints are written and read with
    :mod:`osdp.runtime.dcp`, clipping is :func:`osdp.clip_grad_norm_`, and accumulated micro-batches do not
    communicate until the last.

    Args:
        process_group_backend: ``"gloo"``, ``"nccl"``; default: the one for the accelerator's devices.
        timeout: of collectives.
    """

    def __init__(self, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)

    # -- processes and model -----------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes  # every rank data parallel
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        problem = None
        if self.precision_plugin.precision != "32-true" or type(self.precision_plugin) not in (Precision, OSDPPrecision):
            problem = (f"Trainer(precision={self.precision_plugin.precision!r}): an osdp plan owns precision; "
                       "leave the Trainer at '32-true' and wrap with osdp.wrap(..., mixed_precision='bf16')")
        # every rank checks, all fail together before any collective of the step
        problem = problem or module_problem(self.lightning_module, self.world_size)
        raise_on_any_rank(None if problem is None else IntegrationError(f"osdp.integrations.lightning: {problem}"))
        if type(self.precision_plugin) is Precision:
            self.precision_plugin = OSDPPrecision()
        super().setup(trainer)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication for the micro-batches that ``accumulate_grad_batches`` accumulates."""
        roots = list(osdp_roots(self.lightning_module).values()) if self.lightning_module is not None else []
        for root in roots:
            root.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)

    # -- checkpoints: model and optimizer with osdp.runtime.dcp, the rest in meta.pt -----------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved by save_checkpoint, with osdp.runtime.dcp (not gathered here a second time)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # likewise

    def _optimizer(self) -> torch.optim.Optimizer | None:
        problem = None
        if len(self.optimizers) > 1:
            problem = (f"{len(self.optimizers)} optimizers: osdp checkpoints hold one optimizer's state; "
                       "configure_optimizers() must return one optimizer to save or resume")
        raise_on_any_rank(None if problem is None else IntegrationError(f"osdp.integrations.lightning: {problem}"))
        if not self.optimizers:
            return None
        optimizer = self.optimizers[0]
        return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer holds the torch one

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Write the model and the optimizer (every rank its shards) and Lightning's state, to the directory
        ``filepath``. Collective."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        osdp_checkpoint.save(path, self.lightning_module, self._optimizer(),
                             extra={"step": int(checkpoint.get("global_step", 0))})
        error = None
        if self.global_rank == 0:
            try:
                tmp = path / (METADATA_NAME + ".tmp")
                torch.save(checkpoint, tmp)
                os.replace(tmp, path / METADATA_NAME)
            except OSError as e:
                error = osdp_checkpoint.CheckpointError(f"cannot write {path / METADATA_NAME}: {e}")
        raise_on_any_rank(error)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model (and, when fitting, the optimizer) in place; return Lightning's state. Collective."""
        path = Path(self.broadcast(str(checkpoint_path)))
        problem = None
        if not (path / METADATA_NAME).is_file():
            problem = (f"{path} is not a checkpoint saved by OSDPStrategy (no {METADATA_NAME}); "
                       "it was cut short, or saved by another strategy")
        raise_on_any_rank(None if problem is None else IntegrationError(f"osdp.integrations.lightning: {problem}"))
        osdp_checkpoint.load(path, self.lightning_module, self._optimizer())
        return torch.load(path / METADATA_NAME, map_location="cpu", weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded by load_checkpoint


__all__ = ["IntegrationError", "OSDPPrecision", "OSDPStrategy", "module_problem", "osdp_roots"]
