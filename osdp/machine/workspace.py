"""The memory PyTorch's matmul libraries keep on a CUDA device for the whole run: cuBLAS's and cuBLASLt's
workspaces.

PyTorch gives each thread that runs matmuls its own cuBLAS handle, and each handle (per stream) its own
workspace, allocated through the caching allocator at its first matmul and kept until the process ends.
A training step runs matmuls on two threads, the forward's and autograd's device thread, so it holds two
of each: on an H200 with torch 2.11 (CUDA 13), 2 x (32 MiB + 1 MiB) = 66 MiB, which
``torch.cuda.max_memory_allocated`` counts in every step's peak (``experiments/results/gpu/nvidia-h200.*``:
66 MiB allocated before each plan's model was built). The CPU has none.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

import torch

MiB = 2**20
TRAINING_THREADS = 2  # the forward's thread and autograd's device thread


def cublas_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS handle's workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT``, repeated) where set, else
    PyTorch's default (32 MiB on Hopper and Blackwell, compute capability 9, 10 and 12; 8 MiB + 128 KiB
    before)."""
    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 1024 * 8 if capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(env: Mapping[str, str] | None = None) -> int:
    """One cuBLASLt handle's workspace: ``CUBLASLT_WORKSPACE_SIZE`` (KiB) where set, else 1 MiB (measured with
    torch 2.11 on an H200: a Linear with a bias, PyTorch's cuBLASLt path, allocated 1 MiB that
    ``torch._C._cuda_clearCublasWorkspaces`` frees)."""
    size = (os.environ if env is None else env).get("CUBLASLT_WORKSPACE_SIZE")
    return int(size) * 1024 if size else MiB


def training_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """What a training step on a CUDA device of ``capability`` holds in matmul workspaces (both threads)."""
    return TRAINING_THREADS * (cublas_workspace_bytes(capability, env) + cublaslt_workspace_bytes(env))


def device_workspace_bytes(device: torch.device) -> int:
    """What a training step on ``device``, in this process's environment, holds in matmul workspaces."""
    if device.type != "cuda":
        return 0
    return training_workspace_bytes(torch.cuda.get_device_capability(device))
