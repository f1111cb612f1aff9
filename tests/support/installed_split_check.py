"""Run by tests/test_install.py with the Python of a fresh virtual environment holding the installed
wheel: on 2 gloo ranks, a split Linear (k = 2) through the C++ op takes one SGD step, compared with
nn.Linear on the global batch in one process. Prints one JSON line per rank."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh


def _split_step(rank, world_size):
    import osdp
    import osdp.split as split
    from osdp.split import SplitLinear, _extension

    torch.manual_seed(0)
    reference = nn.Linear(32, 48)
    xs = [torch.randn(4, 32) for _ in range(world_size)]  # the same on every rank: rank r's batch is xs[r]
    module = SplitLinear.from_linear(copy.deepcopy(reference), 2, init_device_mesh("cpu", (world_size,)))

    y = module(xs[rank])
    y.square().mean().backward()
    dist.all_reduce(module.bias.grad, op=dist.ReduceOp.AVG)  # the bias is its owner's to reduce (FSDP2 in a plan)
    torch.optim.SGD(module.parameters(), lr=0.1).step()

    y_ref = reference(xs[rank]).detach()
    sum(reference(x).square().mean() for x in xs).div(world_size).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    errors = {
        "output": (y.detach() - y_ref).abs().max().item(),
        "weight": (module.weight.full_tensor() - reference.weight).abs().max().item(),
        "bias": (module.bias - reference.bias).abs().max().item(),
    }
    return dict(backend=split.backend(), osdp_file=osdp.__file__, osdp_version=osdp.__version__,
                library=_extension._ext.__file__, errors=errors)


if __name__ == "__main__":
    for result in run_ranks(_split_step, 2, timeout=240):
        print(json.dumps(result))
