"""SplitLinear: an nn.Linear whose weight is gathered in k slices, and the rule for which Linears to split."""

from __future__ import annotations

import collections
import math
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from osdp.distributed import collectives as comm
from osdp.distributed.layouts import to_parameter_layout
from osdp.split import _extension, _loop

# Linears smaller than this (weight elements) are not worth k extra collectives;
# small enough that the MLP Linears of tiny test models still qualify.
MIN_SPLIT_NUMEL = 2**12


def split_layout(out_features: int, world_size: int, k: int) -> tuple[int, list[int]]:
    """(rows per rank, rows of each slice per rank) for ``out_features`` rows on ``world_size`` ranks.

    Rows per rank is the chunk of DTensor's (and FSDP2's) Shard(0), ``ceil(out / N)``;
    the tail ranks pad theirs. It is cut into min(k, rows) balanced pieces.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    rows = math.ceil(out_features / world_size)
    pieces = min(k, rows)
    return rows, [rows // pieces + (1 if i < rows % pieces else 0) for i in range(pieces)]


@register_sharding([torch.ops.aten._is_any_true.default, torch.ops.aten._is_all_true.default])
def _whole_tensor_checks(_tensor):
    # Anomaly detection (torch.autograd.detect_anomaly) checks every gradient a backward node gives for NaN with
    # these ops; a split weight's is a DTensor (from ``to_local``'s backward), which DTensor has no strategy for:
    # checked on the whole tensor, as anomaly detection checks it under every other plan (it is slow anyway).
    return [([Replicate()], [Replicate()])]


class _SplitLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, w_local: torch.Tensor, bias: torch.Tensor | None, module: "SplitLinear",
                reduce_dtype: torch.dtype | None):
        impl = _extension.implementation()
        group = module.weight.device_mesh.get_group()
        pairwise_gather = comm.all_gather_impl() == "pairwise"  # NCCL's traffic on gloo (osdp.distributed.collectives)
        y = impl.forward(x2d, w_local, group, module.piece_sizes, module.out_features, pairwise_gather)
        if bias is not None:
            y.add_(bias)
        # what nn.Linear saves: the input only where the weight's gradient needs it (a frozen weight's, as LoRA
        # leaves its base Linears, does not), so that a split unit keeps what the describe measured unsplit
        ctx.save_for_backward(x2d if ctx.needs_input_grad[1] else None, w_local)
        ctx.impl, ctx.group, ctx.module, ctx.reduce_dtype = impl, group, module, reduce_dtype
        ctx.x_dtype, ctx.bias_dtype = x2d.dtype, None if bias is None else bias.dtype
        return y  # 2-D: a view returned from a Function could not be written in place (nn.ReLU(inplace=True))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x2d, w_local = ctx.saved_tensors
        module = ctx.module
        need_x, need_w, need_b, _, _ = ctx.needs_input_grad
        grad_y = grad_y.reshape(-1, module.out_features).contiguous()
        if x2d is None:  # not saved: the loops read only its shape, dtype and device then
            x2d = torch.zeros((), dtype=ctx.x_dtype, device=grad_y.device).expand(grad_y.shape[0], module.in_features)
        # NCCL's traffic on gloo (osdp.distributed.collectives)
        pairwise_reduce = comm.reduce_scatter_impl() == "pairwise"
        pairwise_gather = comm.all_gather_impl() == "pairwise"
        accumulating = need_w and (not module.requires_gradient_sync or module.accumulated_grad is not None)
        grad_x, grad_w = ctx.impl.backward(
            grad_y, x2d, w_local, ctx.group, module.piece_sizes, module.out_features, need_x,
            need_w and not accumulating, ctx.reduce_dtype, pairwise_reduce, pairwise_gather,
        )
        if accumulating:  # one reduction per accumulation window, with the micro-batch that syncs
            module.accumulated_grad = _loop.accumulate_weight_grad(
                module.accumulated_grad, grad_y, x2d, ctx.group, module.piece_sizes, module.out_features,
                ctx.reduce_dtype,
            )
            if module.requires_gradient_sync:
                grad_w = _loop.reduce_accumulated(module.accumulated_grad, w_local, ctx.group, module.piece_sizes,
                                                  pairwise_reduce)
                module.accumulated_grad = None
        if grad_w is not None and module.gradient_divide_factor is not None:
            grad_w.mul_(ctx.group.size() / module.gradient_divide_factor)  # reduced as a mean: the sum / factor
        grad_b = grad_y.sum(0).to(ctx.bias_dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose weight is sharded over a 1-D mesh and gathered in k slices.

    It is an ``nn.Linear`` to the user's code (``isinstance(m, nn.Linear)``, as
    FSDP2's ``FSDPLinear`` is), since a plan the user never sees chooses it:
    optimizer groups built by module type, and initialisations applied by it,
    find the same modules under every plan.

    ``weight`` is a Parameter holding a DTensor with placement Shard(0), exactly
    as FSDP2 holds a sharded ``nn.Linear`` weight (rank r: rows
    ``[r*c, (r+1)*c)``, c = ceil(out / N), fewer or none on the tail ranks).
    Optimizers, ``state_dict()``, ``torch.distributed.checkpoint`` and its
    ``get/set_model_state_dict`` therefore treat it like any FSDP2 parameter,
    under the key ``weight``; checkpoints move between split and unsplit
    models (see ``osdp/split/__init__.py``).

    Each rank cuts its c rows into k pieces; slice i is piece i of every rank,
    i.e. k slices of output rows, each sharded over the N ranks. Forward
    all-gathers slice i+1 while slice i multiplies into its columns of the
    output; backward gathers again for the input gradient and reduce-scatters
    each slice's weight gradient (mean over ranks, like FSDP2) behind the next
    slice's compute. At most two gathered slices exist at a time: the peak of
    gathered weight is 2/k of the full weight (1 for k = 1), measured by
    ``osdp.split.memory_stats()``.

    ``bias`` stays an ordinary Parameter for the enclosing FSDP2 unit to manage.
    With ``mp_policy``, inputs are cast to its ``param_dtype`` and slices are
    gathered in it; gradients are reduced in ``reduce_dtype`` (default: the
    compute dtype), as FSDP2 does.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, k: int, *, mp_policy: MixedPrecisionPolicy | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: the weight is given, sharded
        self._hold(weight, bias, k, mp_policy)

    def _hold(self, weight: nn.Parameter, bias: nn.Parameter | None, k: int,
              mp_policy: MixedPrecisionPolicy | None) -> None:
        if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
            raise ValueError("SplitLinear needs its weight as a DTensor with placements (Shard(0),) on a 1-D mesh")
        self.out_features, self.in_features = weight.shape
        self.k = k
        self.rows_per_rank, self.piece_sizes = split_layout(self.out_features, weight.device_mesh.size(), k)
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.register_parameter("bias", bias)
        mp_policy = mp_policy or MixedPrecisionPolicy()
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce_dtype
        # Gradient accumulation (osdp.set_requires_gradient_sync): while False, backward adds the full, unreduced
        # weight gradient here (the unsharded gradient FSDP2 keeps in the same case) and reduces nothing; the
        # backward that syncs reduce-scatters it once, slice by slice.
        self.requires_gradient_sync = True
        self.accumulated_grad: torch.Tensor | None = None
        # FSDP2's set_gradient_divide_factor on the unit: the reduced weight gradient is the ranks' sum divided by
        # it (None: their mean)
        self.gradient_divide_factor: float | None = None
        # a plain full weight (the nn.Linear's it replaced) loads as this rank's rows; a DTensor of another layout
        # as its full tensor's rows
        self.register_load_state_dict_pre_hook(to_parameter_layout)

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None) -> "SplitLinear":
        """Make ``linear`` a SplitLinear in place, keeping this rank's rows of its weight (the same full weight on
        every rank) and its bias: the same module object, as ``fully_shard`` keeps it, so that the hooks registered
        on it (activation logging, a pruning mask), attributes set on it and references to it hold under every
        plan."""
        if mesh.ndim != 1:
            raise ValueError(f"SplitLinear needs a 1-D mesh, got {mesh.ndim}-D")
        _extension.implementation()  # build or load the extension now, not between the first forward's collectives
        weight = nn.Parameter(_shard(linear.weight.detach(), mesh), requires_grad=linear.weight.requires_grad)
        bias = linear.bias
        if bias is not None and bias.device != weight.device:
            bias.data = bias.data.to(weight.device)
        linear.__class__ = cls
        linear._hold(weight, bias, k, mp_policy)
        return linear

    # Not traced by torch.compile: the slice loop issues collectives on a process group from C++ (or from
    # Python with asynchronous work handles). It runs eagerly between compiled regions: one graph break.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute_dtype, reduce_dtype = self.param_dtype, self.reduce_dtype
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # as nn.Linear under autocast: multiply (here: gather too) in the autocast dtype; the weight
            # gradient, computed in it, is reduced in the parameter's dtype, as the cast's backward returns it
            compute_dtype = torch.get_autocast_dtype(device_type)
            reduce_dtype = reduce_dtype or self.weight.dtype
        if compute_dtype is not None:
            x = x.to(compute_dtype)
        with torch.autocast(device_type, enabled=False):  # the loop's matmuls run in the dtype chosen above
            y = _SplitLinearFunction.apply(x.reshape(-1, self.in_features), self.weight.to_local(), self.bias, self,
                                           reduce_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The full (out, in) weight on every rank. Collective."""
        return self.weight.full_tensor()

    def extra_repr(self) -> str:
        # nn.Linear's: the plan that chose k is not to show in the user's print(model) (osdp.plan_of says it)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _shard(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's Shard(0) chunk of a tensor that every rank holds in full; no communication."""
    rows = math.ceil(full.shape[0] / mesh.size())
    start = min(mesh.get_local_rank() * rows, full.shape[0])
    # a model built on the meta device keeps its shard there until model.to_empty gives it memory
    device = full.device if full.is_meta else _mesh_device(mesh)
    local = full[start : start + rows].to(device, copy=True).contiguous()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.contiguous().stride())


def splittable_linears(
    module: nn.Module,
    exclude: Iterable[nn.Module] = (),
    min_numel: int = MIN_SPLIT_NUMEL,
    *,
    root: nn.Module | None = None,
) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules that a plan's ``split: k`` for this unit turns into SplitLinear.

    Walks ``module`` (itself included, as name ``""``), not descending into
    ``exclude`` (the nested child units). A Linear qualifies when it is exactly
    ``nn.Linear`` (subclasses such as MultiheadAttention's ``out_proj`` are used
    through their weight by their parent), its weight has at least ``min_numel``
    elements and is not a DTensor already, and neither the weight nor the
    module is shared: the weight appears once among the parameters of
    ``root`` (default ``module``; pass the whole model to see ties across
    units); nor does the weight or bias have gradient hooks of the user's
    (``weight.register_hook(fn)``), which expect the whole gradient and would
    see slices. Shared by the cost model, the search and ``apply_split``.
    """
    excluded = {id(m) for m in exclude}
    occurrences = collections.Counter(id(p) for _, p in (root or module).named_parameters(remove_duplicate=False))
    found: list[tuple[str, nn.Linear]] = []

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in excluded:
            return
        if type(m) is nn.Linear:
            w = m.weight
            hooked = any(p is not None and p._backward_hooks for p in (w, m.bias))
            if w.numel() >= min_numel and not isinstance(w, DTensor) and occurrences[id(w)] == 1 and not hooked:
                found.append((name, m))
            return
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return found


def apply_split(
    unit: nn.Module,
    k: int,
    mesh: DeviceMesh,
    *,
    exclude: Iterable[nn.Module] = (),
    min_numel: int = MIN_SPLIT_NUMEL,
    root: nn.Module | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[str]:
    """Make ``splittable_linears(unit, ...)`` SplitLinears in place; return their names (relative to ``unit``).

    The modules stay (``SplitLinear.from_linear``), so paths and state-dict keys
    do. ``k = 1`` means not split (the Plan's convention) and changes nothing.
    ``root``: the model holding ``unit``, to see weights tied across units.
    Call it before ``fully_shard`` of the unit, and pass ``split_parameters(unit)``
    as that call's ``ignored_params``.
    """
    if k < 2:
        return []
    replaced = []
    for name, linear in splittable_linears(unit, exclude, min_numel, root=root):
        SplitLinear.from_linear(linear, k, mesh, mp_policy=mp_policy)  # in place: paths and state-dict keys stay
        replaced.append(name)
    return replaced


def split_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The weights of the SplitLinears under ``module``: the ``ignored_params`` for ``fully_shard``."""
    return {m.weight for m in module.modules() if isinstance(m, SplitLinear)}
