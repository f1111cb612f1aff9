"""Checkpoints of a wrapped model and its optimizer that survive re-planning.

``save(path, model, optimizer)`` writes the model's and the optimizer's state
with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards,
keyed by parameter name (FQN), so ``load(path, model, optimizer)`` reshards
them into whatever the model is now: another plan (modes, splits,
checkpointing, mixed precision) or another number of ranks. Optimizer state is
taken with ``torch.distributed.checkpoint.state_dict.get_state_dict`` and put
back with ``set_state_dict``, so it follows the parameters it belongs to.

Writes are atomic. A checkpoint is written into a hidden temporary directory
next to ``path`` (``.NAME.partial``); when every rank has written its part, rank
0 adds a completion marker (``osdp_checkpoint.json``: step, plan hash, world
size, optimizer class, the caller's ``extra``) and renames the directory into
place. A checkpoint cut short (a rank killed mid-write, a full disk) is never
renamed, carries no marker, and ``latest(dir)`` never picks it; the next save
to the same path clears it.

``export_full(path, model)`` writes one plain ``torch.save`` state dict on rank 0
(gathered, unsharded, on the CPU) that ``load_state_dict`` of the unwrapped model
accepts: the way out of OSDP.

Every function here is a collective when a process group exists: call it on
every rank. Checks that can fail (a missing or foreign checkpoint, a model it
does not fit) run on every rank before any collective and fail on every rank
together. The directory must be on a file system that every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from osdp.distributed import broadcast_object, peer_failures, raise_on_any_rank, world
from osdp.report import first_few

MARKER = "osdp_checkpoint.json"
FORMAT = "osdp-checkpoint"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or does not fit the model or optimizer given."""


# -- locations -------------------------------------------------------------------


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """Where ``save_step`` puts step ``step``: ``DIR/step_00000042``."""
    return Path(directory) / f"{STEP_PREFIX}{step:08d}"


def _partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def info(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of the checkpoint at ``path``; CheckpointError if it is not a complete checkpoint."""
    path = Path(path)
    marker = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: no such directory")
    try:
        record = json.loads(marker.read_text())
    except FileNotFoundError:
        hint = ""
        found = latest(path)
        if found is not None:
            hint = f"; the newest complete checkpoint under it is {found}"
        raise CheckpointError(
            f"{path} is not a complete osdp checkpoint (no {MARKER}: it was never finished, or it is not "
            f"an osdp checkpoint){hint}"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable completion marker {MARKER}: {e}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MARKER} is not an osdp checkpoint marker")
    if record.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {record.get('version')!r}; this osdp reads version {FORMAT_VERSION}"
        )
    return record


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directly under ``directory`` (highest step), or None.

    Only directories with a valid completion marker count: partial writes
    (hidden ``.NAME.partial`` directories, or anything without the marker) are
    ignored. Checkpoints saved without a step rank below every numbered one.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best: tuple[int, str] | None = None
    found: Path | None = None
    for child in directory.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            record = json.loads((child / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != FORMAT_VERSION:
            continue
        step = record.get("step")
        key = (step if isinstance(step, int) else -1, child.name)
        if best is None or key > best:
            best, found = key, child
    return found


def complete_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint directly under ``directory``, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for child in directory.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            record = info(child)
        except CheckpointError:
            continue
        step = record.get("step")
        out.append((step if isinstance(step, int) else -1, child.name, child))
    return [c for _, _, c in sorted(out)]


# -- save ------------------------------------------------------------------------


def _plan_record(model: nn.Module) -> tuple[str | None, dict | None]:
    from osdp.fsdp_ext.apply import plan_of

    try:
        plan = plan_of(model)
    except ValueError:  # not wrapped by osdp: a checkpoint without a plan
        return None, None
    return plan.hash, plan.to_dict()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_marker(directory: Path, record: dict[str, Any]) -> None:
    tmp = directory / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MARKER)


def _publish(partial: Path, path: Path) -> None:
    """Rename the finished ``partial`` to ``path``, replacing an older checkpoint there."""
    _fsync_dir(partial)
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(partial, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically. Collective.

    ``extra``: JSON-serialisable data stored in the completion marker and
    returned by :func:`load` (say, the data position). ``step`` (default:
    ``extra["step"]`` if there is one) orders checkpoints for :func:`latest`.
    An existing checkpoint at ``path`` is replaced only once the new one is complete.
    """
    path = Path(path)
    rank, world_size = world()
    if step is None and isinstance(extra, dict) and isinstance(extra.get("step"), int):
        step = extra["step"]
    plan_hash, plan = _plan_record(model)
    record = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "plan_hash": plan_hash,
        "world_size": world_size,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "extra": extra,
        "plan": plan,
        "torch": torch.__version__,
        "saved_at": time.time(),
    }
    error: Exception | None = None
    try:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        try:
            json.dumps(record)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra must be JSON-serialisable (it is stored in {MARKER}): {e}") from None
        if path.name.startswith("."):
            raise CheckpointError(f"checkpoint names starting with '.' are reserved for partial writes: {path}")
    except CheckpointError as e:
        error = e
    raise_on_any_rank(error)  # every rank fails together, before any write

    partial = _partial_path(path)
    error = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a save that was cut short
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as e:
            error = CheckpointError(f"cannot create the checkpoint directory {partial}: {e}")
    raise_on_any_rank(error)  # also the barrier: nobody writes before the directory is fresh

    with peer_failures(f"saving checkpoint {path}"):
        if optimizer is None:
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
        dcp.save(state, checkpoint_id=str(partial))  # returns once every rank's shards are written

        error = None
        if rank == 0:
            try:
                _write_marker(partial, record)
                _publish(partial, path)
            except OSError as e:
                error = CheckpointError(f"cannot complete the checkpoint {path}: {e}")
        raise_on_any_rank(error)  # nobody returns before the checkpoint is in place
    return path


def save_step(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    keep: int | None = None,
) -> Path:
    """Save to ``DIR/step_<step>`` (see :func:`save`); with ``keep``, then delete all but the newest ``keep``."""
    extra = dict(extra or {})
    extra.setdefault("step", step)
    path = save(step_path(directory, step), model, optimizer, extra, step=step)
    if keep is not None:
        prune(directory, keep)
    return path


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``directory`` (rank 0 deletes). Collective."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    rank, _ = world()
    doomed = complete_checkpoints(directory)[:-keep]
    error: Exception | None = None
    if rank == 0:
        try:
            for old in doomed:
                shutil.rmtree(old)
        except OSError as e:
            error = CheckpointError(f"cannot delete an old checkpoint: {e}")
    raise_on_any_rank(error)
    return doomed


# -- load ------------------------------------------------------------------------


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _saved_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            out[key[len("model."):]] = tuple(meta.size)
    return out


def _check_fits(path: Path, record: dict[str, Any], model_state: dict[str, Any], optimizer) -> None:
    saved_optimizer = record.get("optimizer")
    if optimizer is not None and saved_optimizer is None:
        raise CheckpointError(
            f"{path} holds no optimizer state (it was saved without an optimizer); call load(path, model) "
            "without optimizer=... to load the model alone"
        )
    if optimizer is not None and saved_optimizer != type(optimizer).__name__:
        raise CheckpointError(
            f"{path} holds {saved_optimizer} state, but the optimizer given is {type(optimizer).__name__}"
        )
    try:
        saved = _saved_model_shapes(path)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign directory
        raise CheckpointError(f"{path}: cannot read the DCP metadata: {e}") from None
    mine = _shapes(model_state)
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    wrong = [f"{k} (saved {list(saved[k])}, model {list(mine[k])})" for k in mine if k in saved and saved[k] != mine[k]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"not in the checkpoint: {first_few(sorted(missing), 5)}")
        if unexpected:
            parts.append(f"not in the model: {first_few(sorted(unexpected), 5)}")
        if wrong:
            parts.append(f"different shapes: {first_few(sorted(wrong), 3)}")
        raise CheckpointError(f"{path} was saved from a different model; " + "; ".join(parts))


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``). Collective.

    The model may be wrapped under another plan, or run on another number of
    ranks, than the one that saved it: DCP reshards every tensor. Returns the
    ``extra`` given to :func:`save` (``{}`` if none). Raises CheckpointError on
    every rank, before loading anything, if ``path`` is not a complete
    checkpoint or does not fit the model or optimizer.
    """
    path = Path(path)
    error: Exception | None = None
    record: dict[str, Any] = {}
    state: dict[str, Any] = {}
    try:
        record = info(path)
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
        _check_fits(path, record, state["model"], optimizer)
    except CheckpointError as e:
        error = e
    raise_on_any_rank(error)

    with peer_failures(f"loading checkpoint {path}"):
        dcp.load(state, checkpoint_id=str(path))
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(record.get("extra") or {})


# -- full export -----------------------------------------------------------------


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state dict on rank 0, on the CPU (empty on other ranks). Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with peer_failures("gathering the full state dict"):
        state = get_model_state_dict(model, options=options)
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def export_full(path: str | os.PathLike, model: nn.Module) -> Path | None:
    """Write the whole model as a plain ``torch.save`` state dict on rank 0. Collective.

    The file loads with ``torch.load`` and ``nn.Module.load_state_dict`` of the
    model as built, before ``osdp.wrap`` (split Linears and tied weights keep
    their ordinary keys). Written to a temporary file and renamed, so a reader
    never sees half a file. Returns the path on rank 0, None elsewhere.
    """
    path = Path(path)
    rank, _ = world()
    state = full_state_dict(model)
    error: Exception | None = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.partial"
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            error = CheckpointError(f"cannot write the full state dict to {path}: {e}")
    raise_on_any_rank(error)
    return path if rank == 0 else None


def agree_on_latest(directory: str | os.PathLike) -> Path | None:
    """``latest(directory)`` as rank 0 sees it, on every rank. Collective."""
    rank, _ = world()
    found = latest(directory) if rank == 0 else None
    found = broadcast_object(None if found is None else str(found))
    return None if found is None else Path(found)


__all__ = [
    "CheckpointError", "MARKER", "agree_on_latest", "complete_checkpoints", "export_full", "full_state_dict",
    "info", "latest", "load", "prune", "save", "save_step", "step_path",
]
