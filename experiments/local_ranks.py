"""Run a function on N local gloo ranks of one thread each and take rank 0's result (for experiments)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def _worker(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, queue) -> None:
    from osdp.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, master_port=port, timeout_s=timeout_s)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def rank0_result(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600.0) -> Any:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` importable: module level); rank 0's return value.
    Collectives time out after ``timeout_s``, and so does the wait for the result."""
    from osdp.distributed import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, fn, args, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=60)
