"""Which machine this is: the CPU model, the accelerator, the host, for cache keys and records.

One reader of ``/proc/cpuinfo`` for the whole package: the describe cache and
the calibration cache are keyed by it, and every benchmark record names it.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from osdp._version import __version__


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """What a measurement on ``device`` depends on: the GPU's name, or the CPU's and this process's threads."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_model()}:{torch.get_num_threads()} threads"


def host() -> str:
    return socket.gethostname()


@functools.lru_cache(maxsize=4)
def source_commit(source: Path | None = None) -> str | None:
    """The git commit of the checkout osdp runs from (or of ``source``), with ``+`` when its code (``osdp``,
    ``csrc``, ``experiments``) differs from that commit; None outside a checkout.

    A benchmark's record names the code that produced it."""
    source = source or Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "osdp", "csrc", "experiments")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+" if dirty else "")


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where a benchmark ran, for its record: platform, CPU, cores, Python, torch, osdp and its commit, threads,
    GPU, date, load."""
    return {
        "platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "osdp": __version__, "osdp_commit": source_commit(),
        "device": str(device) if device is not None else None, "threads_per_rank": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": os.getloadavg(),
    }


__all__ = ["cpu_model", "device_name", "host", "machine_info", "source_commit"]
