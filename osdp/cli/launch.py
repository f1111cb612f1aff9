"""The one skeleton of every ``osdp`` command that runs on ranks (train, calibrate, validate).

Run directly, the command relaunches itself on ``--nproc`` local ranks through torchrun (so a first run needs
no launcher knowledge); under torchrun (or that relaunch) each process joins the process group, runs the
command's body, and leaves the group however the body ends, so a failing rank never leaves a store behind.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from osdp.distributed import init_from_env, launch_local


def under_torchrun() -> bool:
    return "RANK" in os.environ


def run_on_ranks(module: str, argv: Sequence[str], *, nproc: int, device: str,
                 body: Callable[[torch.device], object], max_restarts: int = 0) -> int:
    """``body(device)`` on every rank of the job: the ranks of this torchrun, else ``nproc`` local ranks that
    ``python -m module argv`` starts. The exit status of the launch (0 when the body returned)."""
    if not under_torchrun():
        return launch_local(nproc, module, list(argv), max_restarts=max_restarts)
    joined = init_from_env(device)
    try:
        body(joined)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
