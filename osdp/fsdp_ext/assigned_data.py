"""``p.data = t`` on a wrapped model's parameter, as on one process.

Between steps every parameter of a wrapped model is a DTensor (FSDP2's shards, and the reducer's views of the
replicated ones: ``fsdp_ext.replicated_view``), and so is a parameter of a sharded unit outside its unit's
forward. Assigning a DTensor's ``.data`` changes nothing: its values live in its local tensor, which the
assignment does not reach, and PyTorch says nothing. Code written for one process or DDP assigns it: SAM puts
its weights back with ``p.data = self.state[p]["old_p"]``, MoCo moves its key encoder with
``k.data = k.data * m + q.data * (1 - m)``, initialisation writes ``m.weight.data = ...``.

So each such parameter is given a class of its own, a DTensor whose ``.data`` assignment writes the values into
its local tensor: from a DTensor of the same layout shard by shard, from a plain tensor of the parameter's
full shape this rank's part of it (every rank assigns alike, as every rank runs the same code). The memory
stays the parameter's (an assignment on one process would alias the tensor assigned; nothing reads that
difference but an in-place write to the assigned tensor afterwards); another shape or dtype raises, saying
what works.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from osdp._torch_private import dtensor_local_part, register_foreach_type

_TENSOR_DATA = torch._C.TensorBase.data  # the attribute every tensor's ``.data`` is
_PARAMETER_NEW = nn.Parameter.__new__.__code__


class AssignableDTensor(DTensor):
    """A DTensor parameter whose ``.data`` can be assigned (the module's docstring). Its operations give
    plain DTensors, as any DTensor's do (a state dict's values are DTensors, which ``torch.load`` with
    ``weights_only`` and ``copy.deepcopy`` take), but ``detach()`` called by ``nn.Parameter(p)``, which requires
    the class kept (``Module._apply`` makes one of the parameter itself: ``model.to(device)``)."""

    def __deepcopy__(self, memo: dict) -> "AssignableDTensor":
        self.__class__ = DTensor  # copied as the DTensor it is (Tensor's deepcopy wants clone() to keep the class)
        try:
            copied = copy.deepcopy(self, memo)
        finally:
            self.__class__ = AssignableDTensor
        make_data_assignable(copied)
        return copied

    def detach(self) -> DTensor:
        detached = super().detach()
        if sys._getframe(1).f_code is _PARAMETER_NEW:
            make_data_assignable(detached)
        return detached

    @property
    def data(self) -> DTensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            _TENSOR_DATA.__set__(self, value)  # raises PyTorch's own error
            return
        if value.shape != self.shape or value.dtype != self.dtype:
            raise RuntimeError(
                f"osdp: a parameter of shape {tuple(self.shape)} and dtype {self.dtype} was assigned `.data` of "
                f"shape {tuple(value.shape)} and dtype {value.dtype}; a wrapped model holds its parameters "
                "sharded or replicated across ranks, whose values `.data = ...` can replace but not their shape "
                "or dtype: assign a tensor of the parameter's own shape and dtype, or change the model before "
                "osdp.wrap")
        if isinstance(value, DTensor):
            if value.device_mesh == self.device_mesh and value.placements == self.placements:
                local = value._local_tensor
            else:
                local = dtensor_local_part(self, value.full_tensor())  # collective: every rank assigns alike
        else:
            local = dtensor_local_part(self, value)
        with torch.no_grad():
            self._local_tensor.copy_(local)


register_foreach_type(AssignableDTensor)  # optimizers step it with their foreach kernels, as any DTensor


def make_data_assignable(param: nn.Parameter) -> None:
    """Give a DTensor parameter the class whose ``.data`` can be assigned (nothing for any other tensor)."""
    if type(param) is DTensor:
        param.__class__ = AssignableDTensor


def make_parameters_data_assignable(model: nn.Module) -> None:
    for param in model.parameters():
        make_data_assignable(param)


def make_data_assignable_at_first_forward(model: nn.Module) -> None:
    """The same, once the model's first forward begins: a model wrapped on the meta device gets new parameters
    from ``to_empty`` (which makes plain DTensors) before it."""
    def mark(module: nn.Module, args) -> None:
        make_parameters_data_assignable(module)
        handle.remove()

    handle = model.register_forward_pre_hook(mark, prepend=True)
