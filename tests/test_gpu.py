"""On one CUDA GPU: PeakMemory against the allocator, the measured description of a GPU model, bf16
training of gpt2-small against fp32, and a checkpoint saved on the GPU loaded on the CPU.

Every test here is marked ``gpu`` and skipped without CUDA (conftest.py). ``pytest -m gpu`` runs them
with the other CUDA tests (the split op's stream path in test_split.py, a model on two devices in
test_bad_inputs.py); ``python experiments/gpu_check.py`` starts with that. Multi-rank code runs on a
one-rank group.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from training_check import full_state

import osdp
from osdp import models
from osdp.describe.measured import describe
from osdp.machine.memory import PeakMemory
from osdp.models.data import synthetic_batch
from osdp.runtime import dcp as checkpoint

pytestmark = pytest.mark.gpu

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def _one_rank(backend: str):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Residual(nn.Module):
    """Residual MLP blocks (one unit each) and a scalar loss: the same ops on CPU and CUDA."""

    def __init__(self, d: int, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


# --------------------------------------------------------------------------- peak memory


def test_peak_memory_on_cuda_is_the_allocators_peak_over_the_block():
    device = _cuda()
    keep = torch.empty(4 * MiB, dtype=torch.uint8, device=device)
    spike = torch.empty(64 * MiB, dtype=torch.uint8, device=device)  # a peak before the block: not counted
    del spike
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with PeakMemory(device) as meter:
        a = torch.empty(8 * MiB, dtype=torch.uint8, device=device)
        b = torch.empty(16 * MiB, dtype=torch.uint8, device=device)
        del a
        c = torch.empty(2 * MiB, dtype=torch.uint8, device=device)
    stats = meter.stats()
    assert stats.baseline_bytes == before
    assert stats.peak_bytes == before + 24 * MiB == torch.cuda.max_memory_allocated(device)
    assert stats.current_bytes == before + 18 * MiB
    assert stats.peak_reserved_bytes >= stats.peak_bytes
    del b, c, keep


def test_peak_memory_of_a_step_on_cuda_equals_the_cpu_trackers():
    """One training step measured by the CUDA allocator and by the CPU live-bytes tracker: the same
    bytes above the baseline (activations, gradients, temporaries), to allocator rounding."""

    def extra_bytes(device: torch.device) -> int:
        torch.manual_seed(0)
        model = _Residual(512).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state, no temporaries, on either device
        x = torch.randn(256, 512, device=device)

        def step() -> None:
            model(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up: cuBLAS workspaces belong to the baseline
        with PeakMemory(device, model, opt, x) as meter:
            step()
        stats = meter.stats()
        return stats.peak_bytes - stats.baseline_bytes

    on_cuda, on_cpu = extra_bytes(_cuda()), extra_bytes(torch.device("cpu"))
    assert on_cpu > 8 * MiB
    assert on_cuda == pytest.approx(on_cpu, rel=0.02, abs=256 * 1024)


def test_a_training_step_holds_the_matmul_workspaces_the_cost_model_prices():
    """In a fresh process (the workspaces live as long as it does), what a step of a model of Linears with
    biases leaves allocated once its tensors are gone is cuBLAS's workspaces: the forward's thread's and
    autograd's, cuBLASLt's beside them where a thread took that path; the cost model prices all four."""
    script = textwrap.dedent("""
        import json, torch, torch.nn as nn
        from osdp.machine.device_info import DeviceInfo  # noqa: F401 (osdp importable: the priced figure below)
        from osdp.machine.workspace import (cublas_workspace_bytes, cublaslt_workspace_bytes,
                                            training_workspace_bytes)
        device = torch.device("cuda", 0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(device)
        x = torch.randn(256, 512, device=device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        capability = torch.cuda.get_device_capability(device)
        print(json.dumps({"held": torch.cuda.memory_allocated(device) - before,
                          "cublas": cublas_workspace_bytes(capability), "cublaslt": cublaslt_workspace_bytes(),
                          "priced": training_workspace_bytes(capability)}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] >= 2 * got["cublas"]  # one cuBLAS workspace per thread: the forward's and autograd's
    assert got["held"] <= got["priced"] == 2 * (got["cublas"] + got["cublaslt"])


# --------------------------------------------------------------------------- the measured description


def test_describe_on_cuda_measures_the_same_bytes_as_on_cpu():
    """The description's memory comes from the live-bytes tracker, which follows CUDA tensors too."""
    costs = []
    for device in (torch.device("cpu"), _cuda()):
        torch.manual_seed(0)
        model = _Residual(256).to(device)
        x = torch.randn(64, 256, device=device)
        d = describe(model, x, batch_sizes=(32, 64), optimizers=("sgd",), cache=False, progress=False,
                     time_budget_s=1.0)
        costs.append({u.path: u.costs["fp32"] for u in d.units})
    on_cpu, on_cuda = costs
    for path, cpu in on_cpu.items():
        cuda = on_cuda[path]
        for b in (32, 64):
            assert cuda.act_bytes.bytes(b) == cpu.act_bytes.bytes(b), path
            assert cuda.ckpt_bytes.bytes(b) == cpu.ckpt_bytes.bytes(b), path
            assert cuda.fwd_peak_bytes.bytes(b) == pytest.approx(cpu.fwd_peak_bytes.bytes(b), rel=0.02, abs=4096), path
            assert cuda.bwd_peak_bytes.bytes(b) == pytest.approx(cpu.bwd_peak_bytes.bytes(b), rel=0.02, abs=4096), path
    assert on_cuda["blocks.0"].act_bytes.bytes(64) > 64 * 512 * 4  # it saw the blocks' activations


def test_describe_on_cuda_times_the_kernels_not_their_launches():
    """A step of large fp32 matmuls takes far longer on the GPU than to launch: describe's step time
    must be the GPU's (CUDA events), and its units must add up to it."""
    device, b = _cuda(), 2048
    torch.manual_seed(0)
    model = _Residual(4096).to(device)
    x = torch.randn(b, 4096, device=device)
    d = describe(model, x, batch_sizes=(b,), optimizers=("sgd",), cache=False, progress=False, time_budget_s=2.0)
    described = d.checks["fp32"][str(b)]["step_s"]
    units_sum = sum(u.costs["fp32"].fwd_s(b) + u.costs["fp32"].bwd_s(b) for u in d.units)
    assert units_sum == pytest.approx(described, rel=0.05)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(x).backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        model.zero_grad(set_to_none=True)
    assert described == pytest.approx(statistics.median(times), rel=0.3)


# --------------------------------------------------------------------------- training and checkpoints


def test_bf16_training_of_gpt2_small_on_one_rank_matches_fp32():
    """osdp.wrap under an FSDP plan in fp32 and in bf16 (bf16 compute, fp32 reduction): the same
    losses and parameter updates, to bf16's precision."""
    device, seq_len = _cuda(), 256
    config = models.get_config("gpt2-small", seq_len=seq_len)
    inputs, targets = (t.to(device) for t in synthetic_batch(config, 4, generator=torch.Generator().manual_seed(0)))
    runs = {}
    with _one_rank("nccl"):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            with torch.device(device):
                model = models.build("gpt2-small", seq_len=seq_len)
            initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            plan = osdp.strategy_plan(model, "fsdp")
            plan.mixed_precision = precision
            osdp.wrap(model, plan=plan, device=device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for _ in range(4):
                loss = model(inputs, targets)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            final = {k: v.cpu() for k, v in full_state(model).items()}
            runs[precision] = losses, torch.cat([(final[k] - initial[k]).flatten() for k in sorted(initial)])
            del model, opt
    (fp32_losses, fp32_update), (bf16_losses, bf16_update) = runs["fp32"], runs["bf16"]
    assert fp32_losses[-1] < fp32_losses[0] and bf16_losses[-1] < bf16_losses[0]
    for a, b in zip(fp32_losses, bf16_losses):
        assert b == pytest.approx(a, rel=0.02)
    cosine = torch.nn.functional.cosine_similarity(fp32_update, bf16_update, dim=0).item()
    assert cosine > 0.98, f"bf16 and fp32 updates point apart: cosine {cosine:.4f}"
    assert (bf16_update - fp32_update).norm() <= 0.2 * fp32_update.norm()


def test_a_checkpoint_saved_on_cuda_loads_on_cpu(tmp_path):
    """Saved on the GPU (one NCCL rank, FSDP), loaded on the CPU (one gloo rank, ZeRO-2): the same
    parameters bit for bit, and training continues as on the GPU; the full export loads too."""
    config = models.get_config("gpt2-tiny")
    batch = synthetic_batch(config, 4, generator=torch.Generator().manual_seed(0))

    def step(model, opt, inputs, targets) -> float:
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    device = _cuda()
    with _one_rank("nccl"):
        torch.manual_seed(0)
        with torch.device(device):
            model = models.build("gpt2-tiny")
        osdp.wrap(model, strategy="fsdp", device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        on_gpu = [t.to(device) for t in batch]
        for _ in range(2):
            step(model, opt, *on_gpu)
        checkpoint.save_step(tmp_path / "ckpt", 2, model, opt)
        checkpoint.export_full(tmp_path / "full.pt", model)
        saved = {k: v.cpu() for k, v in full_state(model).items()}
        gpu_next = [step(model, opt, *on_gpu) for _ in range(2)]
    with _one_rank("gloo"):
        torch.manual_seed(1)  # another initialisation: everything must come from the checkpoint
        model = models.build("gpt2-tiny")
        osdp.wrap(model, strategy="zero2", device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert checkpoint.load(checkpoint.latest(tmp_path / "ckpt"), model, opt) == {"step": 2}
        loaded = full_state(model)
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            torch.testing.assert_close(loaded[key], value, atol=0, rtol=0, msg=key)
        cpu_next = [step(model, opt, *batch) for _ in range(2)]
    assert cpu_next == pytest.approx(gpu_next, rel=1e-4)  # the second step uses the loaded Adam state
    plain = models.build("gpt2-tiny")
    plain.load_state_dict(torch.load(tmp_path / "full.pt", map_location="cpu"))
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, saved[key], atol=0, rtol=0, msg=key)
