"""Run a function on N local gloo ranks of one thread each and take rank 0's result (for experiments)."""

from __future__ import annotations

from typing import Any, Callable

from osdp.distributed.local_ranks import run_local_ranks


def rank0_result(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600.0) -> Any:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` importable: module level); rank 0's return value.
    Collectives time out after ``timeout_s``, and so does the whole run."""
    return run_local_ranks(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=timeout_s)[0]
