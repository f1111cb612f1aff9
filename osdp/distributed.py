"""Process-group helpers: local rank launch, timeouts, and agreement checks.

Everything here runs before any model collective, so that a rank which cannot
proceed says why on every rank instead of leaving the others hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("OSDP_COLLECTIVE_TIMEOUT_S", "300"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | str | None = None) -> str:
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return "nccl"
    if device is None and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def init_process_group(
    rank: int,
    world_size: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join a process group on an explicit TCP store with a collective timeout."""
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=(rank == 0),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(obj: Any) -> list[Any]:
    rank, world_size = world()
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    rank, world_size = world()
    if world_size == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def raise_on_any_rank(error: BaseException | None) -> None:
    """Collective: every rank raises if any rank failed, naming the ranks and the first error.

    Call it after a local check that may fail, so that a failure on one rank
    becomes the same clear error everywhere instead of a hang at the next
    collective.
    """
    rank, world_size = world()
    if world_size == 1:
        if error is not None:
            raise error
        return
    messages = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None and len(failed) == 1:
        raise error
    first = messages[failed[0]]
    exc_type = type(error) if error is not None else RuntimeError
    try:
        raise exc_type(f"rank(s) {failed} failed: {first}")
    except TypeError:  # exception types with unusual constructors
        raise RuntimeError(f"rank(s) {failed} failed: {first}") from None
