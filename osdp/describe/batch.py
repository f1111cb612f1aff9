"""An example input as the describe sees it: its batch size, resized to another, its bytes per sample, fed to
the model (``call_model``) and turned into a loss (``loss_of``).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

from osdp.machine.memory import iter_tensors, map_tensors


class ProfileError(ValueError):
    """The model cannot be described as given (the message names the unit)."""


# --------------------------------------------------------------------------- batches


def batch_size_of(example_input: Any) -> int:
    """The batch size: dim 0 of the example's tensors (which must agree)."""
    sizes = {t.shape[0] for t in iter_tensors(example_input) if t.dim() >= 1}
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"batch dimensions {sorted(sizes)}"
        raise ProfileError(
            f"example_input must hold tensors with one batch size in dim 0 (a tensor, a tuple of "
            f"positional arguments or a dict of keyword arguments); found {found}"
        )
    return sizes.pop()


def resize_batch(example_input: Any, b: int) -> Any:
    """The example with ``b`` samples: its first b rows, or its rows repeated."""
    n = batch_size_of(example_input)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        if b <= n:
            return t[:b].clone(memory_format=torch.contiguous_format)  # its own storage: saved bytes are its bytes
        reps = [math.ceil(b / n)] + [1] * (t.dim() - 1)
        return t.repeat(*reps)[:b].contiguous()

    return map_tensors(resize, example_input)


def input_spec(example_input: Any) -> str:
    """Per-sample shapes and dtypes of the example: part of the cache key."""

    def spec(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return f"{str(obj.dtype).removeprefix('torch.')}{list(obj.shape[1:])}"
        if isinstance(obj, (list, tuple)):
            return [spec(x) for x in obj]
        if isinstance(obj, Mapping):
            return {str(k): spec(v) for k, v in obj.items()}
        return repr(obj)

    return json.dumps(spec(example_input), sort_keys=True)


def held_output_bytes(output: Any, *counted: Any) -> int:
    """Bytes of the storages of what a forward returned, each once, but those of ``counted`` (the parameters,
    the batch: priced already). A training loop keeps the output through its backward and into the next
    forward (``logits, loss = model(x, y)``; a Hugging Face model's ``outputs``), so the step holds it."""
    known = {t.untyped_storage()._cdata for t in iter_tensors(counted)}
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in iter_tensors(output)}
    return sum(nbytes for key, nbytes in storages.items() if key not in known)


def state_storage_keys(model: nn.Module) -> set[int]:
    """The storages of the model's parameters and buffers: they live all step whatever the plan, so a forward that
    saves one for backward (a conv kernel, a pruning mask, a causal mask's slice) saves no activation."""
    return {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the model's buffers, each storage once, but those a parameter shares: FSDP2 shards parameters only,
    so every rank holds every buffer all step (PyTorch's FSDPMemTracker counts them, as BUFFER)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in model.buffers()}
    return sum(nbytes for key, nbytes in storages.items() if key not in params)


def held_all_step(model: nn.Module, example_input: Any, held_output: int, rows: int) -> dict[str, Any]:
    """A description's fields for what the training loop and the model hold all step whatever the plan: the
    example's spec and bytes, the output's (``held_output`` bytes for ``rows`` samples), the buffers'."""
    return dict(input_spec=input_spec(example_input), input_bytes_per_sample=input_bytes_per_sample(example_input),
                output_bytes_per_sample=held_output / rows, buffer_bytes=buffer_bytes(model))


def input_bytes_per_sample(example_input: Any) -> float:
    """Bytes of the example's storages (each once, however many views share it) per sample."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in iter_tensors(example_input)}
    return sum(storages.values()) / batch_size_of(example_input)


def call_model(model: nn.Module, example_input: Any) -> Any:
    """A tensor is one argument, a tuple or list positional arguments, a dict keyword arguments."""
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    return model(example_input)


def kept_for_backward(model: nn.Module, example_input: Any) -> int:
    """Bytes a forward of the example with gradients keeps for its backward: each storage autograd saves, once,
    but the model's parameters and buffers (held all step whatever the batch). Where sizes depend on the data
    (padded sequences packed, bags of varying size) it differs between batches of one shape."""
    state = state_storage_keys(model)
    saved: dict[int, int] = {}  # every saved storage stays alive until the forward's output goes: keys are unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and (key := t.untyped_storage()._cdata) not in state:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
        call_model(model, example_input)
    return sum(saved.values())


@contextlib.contextmanager
def without_grad() -> Iterator[None]:
    """``torch.no_grad()`` for osdp's own looks at the forward, without the warning each of the model's
    reentrant checkpoints gives there ("None of the inputs have requires_grad=True"): the user's training has
    gradients, and that warning would be about osdp's forward, not theirs."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
        yield


def loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """The scalar to call backward on: ``loss_fn(output)``, or the output when it is a loss."""
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProfileError(
            "the model's output is not a scalar loss; pass loss_fn=... (called on the output, "
            "returning a scalar tensor)"
        )
    return loss
