"""The one skeleton of every ``osdp`` command that runs on ranks (train, calibrate, validate).

Run directly, the command relaunches itself on ``--nproc`` local ranks through torchrun (so a first run needs
no launcher knowledge); under torchrun (or that relaunch) each process joins the process group, runs the
command's body, and leaves the group however the body ends, so a failing rank never leaves a store behind.
One rank (``--nproc 1`` without restarts) runs in this process, as torchrun's only worker would: the launcher
and the worker would be two more interpreters to start (about 7 s of imports on 2 cores) for nothing.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from osdp.distributed import free_port, init_from_env, launch_local


def under_torchrun() -> bool:
    return "RANK" in os.environ


def run_on_ranks(module: str, argv: Sequence[str], *, nproc: int, device: str,
                 body: Callable[[torch.device], object], max_restarts: int = 0) -> int:
    """``body(device)`` on every rank of the job: the ranks of this torchrun, else ``nproc`` local ranks that
    ``python -m module argv`` starts. The exit status of the launch (0 when the body returned)."""
    if under_torchrun():
        return _as_a_worker(device, body)
    if nproc == 1 and not max_restarts:
        return _as_the_only_worker(device, body)
    return launch_local(nproc, module, list(argv), max_restarts=max_restarts)


def _as_a_worker(device: str, body: Callable[[torch.device], object]) -> int:
    joined = init_from_env(device)
    try:
        body(joined)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _as_the_only_worker(device: str, body: Callable[[torch.device], object]) -> int:
    """``body`` on a one-rank job in this process, with the environment torchrun gives its worker (restored
    after)."""
    worker = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    before = {k: os.environ.get(k) for k in worker}
    os.environ.update(worker)
    try:
        return _as_a_worker(device, body)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
