"""Describe a model without running it: FLOPs and a fake-tensor trace, for planning offline.

``describe_analytic(model, example_input, device)`` gives the same
``ModelDescription`` as ``osdp.describe.measured.describe`` without the hardware, so a
1.5B-parameter model can be planned for 8 GPUs on a laptop in seconds:

* memory: the very same forward and backward pass as the measured
  description (``osdp.describe.measure.memory_pass``: saved-tensor attribution, working
  sets from ``osdp.machine.memory.LiveBytesTracker``), run on fake tensors
  (``FakeTensorMode``): every shape and byte is real, no storage is
  allocated. It matches the measured description byte for byte where the
  kernels are the same (CPU); fused device kernels (flash attention on CUDA)
  may save less. One pass less: the measured description also measures the
  checkpointed units' recomputed working sets, which add to the plain pass's
  only where a unit's recompute holds more than its plain backward (an LSTM,
  PyTorch's MultiheadAttention; not the GPT blocks), and which would double the analytic
  description of a large model (gpt2-xl: 87 s to 193 s on a 2-core VM).
* time: FLOPs per unit and phase (``torch.utils.flop_counter``, attributed to
  units like the measured times) divided by the device's achievable FLOP/s
  (``DeviceInfo.flops``, a preset or ``osdp.machine.measure.measure_flops``). Ops
  without FLOPs (norms, activations, softmax) count as free and the
  optimizer step as instant, so analytic step times are optimistic where
  memory bandwidth matters.

The model may be on the meta device (``with torch.device("meta"):
models.build("gpt2-xl")``) or a real one; it is never modified. Descriptions
are cached as the measured ones are (``osdp.describe.measured``: keyed by the
model's structure and settings, the input, sizes, precisions and the device),
so planning a model again (other budgets, node counts) skips the trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from osdp.describe.batch import ProfileError, batch_size_of, held_all_step, input_spec, resize_batch
from osdp.describe.measure import fit_costs, in_precision, memory_pass, resolve_units, unit_profiles
from osdp.describe.cache import PROFILE_VERSION, cache_key, cached_path, model_fingerprint, read_cached
from osdp.describe.units import Unit, build_units, checkpointable, structure_signature
from osdp.log import Progress
from osdp.machine.device_info import DeviceInfo
from osdp.machine.memory import map_tensors
from osdp.machine.presets import device_preset
from osdp.schema.description import PRECISIONS, ModelDescription, UnitWorkload
from osdp.store import write_atomically


@contextlib.contextmanager
def faked(model: nn.Module, mode: FakeTensorMode) -> Iterator[nn.Module]:
    """``model`` itself with its parameters and buffers swapped for fake CPU tensors (ties kept, nothing
    allocated), restored after. The same modules, so that a forward reaching one through a closure (minGPT's
    ``mlpf`` lambda) runs on fakes too; a copy left those on the real tensors and the forward failed."""

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")

    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in list(getattr(module, kind).items()):
                    if t is None:
                        continue
                    if id(t) not in fakes:
                        fakes[id(t)] = (nn.Parameter(fake(t), requires_grad=t.requires_grad)
                                        if kind == "_parameters" else fake(t))
                    swapped.append((module, name, t))
                    setattr(module, name, fakes[id(t)])  # through __setattr__: an RNN's flat weights follow
        yield model
    finally:
        for module, name, t in reversed(swapped):
            setattr(module, name, t)


def _fake_batch(example_input: Any, mode: FakeTensorMode) -> Any:
    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")

    return map_tensors(fake, example_input)


class _Flops:
    """FLOPs per (phase, unit) between segment boundaries."""

    def __init__(self, counter: FlopCounterMode):
        self.counter, self.last, self.flops = counter, 0, {}

    def __call__(self, owner: str, phase: str) -> None:
        total = self.counter.get_total_flops()
        self.flops[(phase, owner)] = self.flops.get((phase, owner), 0) + total - self.last
        self.last = total


def _check_rates(info: DeviceInfo, precisions: Sequence[str]) -> None:
    """ProfileError unless every precision is known and ``info`` has a FLOP/s figure for it."""
    for p in precisions:
        if p not in PRECISIONS:
            raise ProfileError(f"precision {p!r} is not one of {list(PRECISIONS)}")
        rate = info.flops.get(str(PRECISIONS[p]).removeprefix("torch."), 0.0)
        if not rate > 0:
            raise ProfileError(
                f"device {info.name!r} has no FLOP/s figure for {p}: measure one (osdp.machine.measure.measure_flops) "
                "or use a preset that has it"
            )


def describe_analytic(
    model: nn.Module,
    example_input: Any,
    device: DeviceInfo | str,
    *,
    world_size: int = 1,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    batch_sizes: Sequence[int] | None = None,
    precisions: Sequence[str] = ("fp32",),
    units: Sequence[Unit] | None = None,
    granularity: str = "sub-block",
    progress: bool = True,
    name: str | None = None,
    cache: bool = True,
    uneven: Sequence[str] = (),
    unless_units: Collection[frozenset[str]] = (),
) -> ModelDescription | None:
    """A ``ModelDescription`` from FLOPs and a fake-tensor trace (see the module docstring).

    ``device``: a ``DeviceInfo`` or a preset name (``osdp.machine.presets.DEVICE_PRESETS``;
    ``world_size`` is only needed to build it). ``example_input`` may be real or
    meta tensors; only shapes and dtypes are used. ``cache``: read and write the describe cache. ``uneven``:
    as ``osdp.describe.measured.describe`` takes it. ``unless_units``: unit path sets already described (at
    another granularity): None, after one checked forward, where the units found are one of them.
    """
    start = time.perf_counter()
    units_given = units
    info = device if isinstance(device, DeviceInfo) else device_preset(device, world_size)
    _check_rates(info, precisions)
    if next(model.parameters(), None) is None:
        raise ProfileError("the model has no parameters: there is nothing to describe")
    n = batch_size_of(example_input)
    sizes = tuple(sorted(set(batch_sizes or (max(1, n // 2), n))))
    name = name or getattr(getattr(model, "config", None), "name", None) or type(model).__name__
    show = Progress(f"describe {name} (analytic)", progress)
    path = _cache_path(model, example_input, info, name=name, units=units, granularity=granularity, sizes=sizes,
                       precisions=precisions, loss_fn=loss_fn, uneven=uneven)
    cached = read_cached(path) if cache else None
    if cached is not None:
        show.done(f"from cache {path}")
        return (None if frozenset(cached.paths) in unless_units
                else dataclasses.replace(cached, device=info.name, source=_source(info)))

    mode = FakeTensorMode()
    fake_input = _fake_batch(example_input, mode)
    costs: dict[str, dict[str, UnitWorkload]] = {}
    with mode, faked(model, mode):
        show("checking the forward")
        units, routed, held = resolve_units(model, resize_batch(fake_input, sizes[0]), loss_fn, units,
                                            granularity, uneven)
        if frozenset(u.path for u in units) in unless_units:
            show.done("the same units as another granularity's")
            return None
        for prec in precisions:  # bf16 as FSDP2's mixed precision computes it (``in_precision``)
            dtype = PRECISIONS[prec]
            with in_precision(model, units, dtype) if prec != "fp32" else contextlib.nullcontext():
                costs[prec], order = _costs_at(model, build_units(model, [u.path for u in units]), fake_input,
                                               sizes, prec, info.flops_for(dtype), loss_fn, show, routed)
        profiles = unit_profiles(model, units, costs, routed)
    description = ModelDescription(
        model=name,
        signature=structure_signature(model),
        units=profiles,
        batch_sizes=sizes,
        precisions=tuple(precisions),
        optimizer_s_per_byte={},
        source=_source(info),
        device=info.name,
        **held_all_step(model, example_input, held, sizes[0]),
        forward_order=tuple(order),
        profile_seconds=time.perf_counter() - start,
        granularity=granularity if units_given is None else "given",
        routed=routed,
    )
    show.done(f"done in {description.profile_seconds:.1f}s")
    if cache:
        write_atomically(path, description.to_json())
    return description


def _cache_path(model: nn.Module, example_input: Any, info: DeviceInfo, *, name: str, units, granularity: str,
                sizes: tuple[int, ...], precisions: Sequence[str], loss_fn, uneven: Sequence[str]):
    """Where the description of this model, batch and settings is cached. Of the device it keys only what the
    describe reads, its FLOP/s: the same model planned on another network or at another world size is
    described once."""
    return cached_path(cache_key({
        "version": PROFILE_VERSION, "kind": "analytic", "model": model_fingerprint(model), "name": name,
        "units": [u.path for u in units] if units is not None else None, "granularity": granularity,
        "input": input_spec(example_input), "sizes": sizes, "precisions": list(precisions),
        "flops": {p: info.flops_for(PRECISIONS[p]) for p in precisions}, "device_type": info.device_type,
        "torch": torch.__version__, "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)) if loss_fn else None,
        "uneven": list(uneven),
    }), "analytic")


def _source(info: DeviceInfo) -> str:
    return f"analytic: FLOPs at {info.name}'s FLOP/s, memory from a fake-tensor trace"


def _costs_at(runnable: nn.Module, units: Sequence[Unit], fake_input: Any, sizes: Sequence[int], prec: str,
              rate: float, loss_fn, show: Progress, routed: Sequence[str]) -> tuple[dict[str, UnitWorkload], list[str]]:
    """Every unit's workload at precision ``prec`` (``runnable``: the fake model in it, ``rate``: the device's
    FLOP/s in it; ``routed``: see ``memory_pass``), and the order the units ran in."""
    memory, seconds, flops = {}, {}, {}
    order: list[str] = []
    for i, b in enumerate(sizes):
        show(f"{prec}: micro-batch {b} ({i + 1}/{len(sizes)})")
        counter = FlopCounterMode(display=False)
        meter = _Flops(counter)
        with counter:  # without the checkpointed pass, which would double the describe of a large model
            memory[b], order = memory_pass(runnable, units, resize_batch(fake_input, b), loss_fn, meter,
                                           recomputed=False, routed=routed)
        flops[b] = meter.flops
        seconds[b] = {k: f / rate for k, f in meter.flops.items()}
    # compute is priced by FLOPs: a recompute redoes those of the ops it does not keep up to the unit's last saved
    # tensor (KeptBySelective)
    redone = {policy: {b: {u.path: memory[b][u.path][f"{policy}_recompute_flops"] / rate
                           for u in checkpointable(units)} for b in sizes}
              for policy in ("full", "selective")}
    return fit_costs(units, sizes, memory, seconds, flops, recompute_seconds=redone), order
