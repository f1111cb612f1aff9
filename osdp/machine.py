"""Which machine this is: the CPU model, the accelerator, the host, for cache keys and records.

One reader of ``/proc/cpuinfo`` for the whole package: the describe cache and
the calibration cache are keyed by it, and every benchmark record names it.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch


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


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where a benchmark ran, for its record: platform, CPU, cores, Python, torch, threads, GPU, date, load."""
    return {
        "platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "device": str(device) if device is not None else None, "threads_per_rank": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": os.getloadavg(),
    }


__all__ = ["cpu_model", "device_name", "host", "machine_info"]
