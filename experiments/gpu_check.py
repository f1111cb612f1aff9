"""GPU proof: every GPU check of OSDP on one GPU, in one command, in under 9 minutes.

    python experiments/gpu_check.py             # one CUDA GPU: experiments/results/gpu/<device>.json and .md
    python experiments/gpu_check.py --dry-run   # CPU, tiny sizes: every part set up and run, about a minute

One GPU has no second rank, so nothing here communicates between GPUs: multi-rank
code runs as one rank of a real group, or as rank 0 of 8 under the fake process
group (``osdp._torch_private.init_fake_process_group``: FSDP2 shards, gathers
and frees as rank 0 of 8 does, so compute and memory are real, but the
collectives are not executed), and every record says which.

1. tests: ``pytest -m gpu`` (tests/test_gpu.py and the CUDA tests elsewhere: the
   split op's stream path against nn.Linear in fp32 and bf16, a model on two
   devices, PeakMemory against the allocator, the measured description on CUDA,
   bf16 training of gpt2-small against fp32, a checkpoint saved on the GPU loaded
   on the CPU), in a subprocess; the dry run only collects them.
2. overlap: the split op's C++ stream path on a 4096 -> 16384 Linear at k = 2, 4, 8
   with a stand-in for its collectives: copies of each slice from pinned host
   memory, and of each weight-gradient slice to it, on the op's communication
   stream (``bench_split.StandInSplit``); CUDA events. Hidden fraction of the
   gather time, and step time against the unsplit Linear.
3. memory: gpt-48l-h1536 (the OSDP paper's model), rank 0 of 8 under the fake
   group, fp32, AdamW: OSDP's plans at 8, 6 and 4 GiB, FSDP, ZeRO-2 and five more
   fixed plans (``gpu_paper_config``); predicted peak against
   ``torch.cuda.max_memory_allocated`` per plan.
4. compute: the same plans' measured compute step (no communication under the
   fake group) against the cost model's prediction from the model measured on
   this GPU (``osdp.describe.measured.describe``) and from the analytic description; Kendall
   tau. The CUDA presets' matmul FLOP/s against what this GPU measures.
5. user_path: the path users take, ``osdp train --device cuda --nproc 1 --model gpt2-small
   --mixed-precision bf16`` (NCCL, one rank: a real calibration and description on CUDA, a searched
   plan applied): DDP first, then OSDP at budgets below DDP's measured peak; predicted against measured
   step and peak (``torch.cuda.max_memory_allocated``), tokens/s and MFU.
6. mfu: gpt2-small and gpt2-medium, bf16 autocast training on one GPU, eager and
   ``torch.compile``: tokens/s and MFU against the data-sheet bf16 peak.

A part that fails records its error and the others still run; the record is written after every part,
so a run stopped from outside keeps what it finished. ``--time-limit`` (seconds for the whole run) skips
a part, and the compiled MFU runs, when too little is left for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import torch

EXPERIMENTS = Path(__file__).resolve().parent
ROOT = EXPERIMENTS.parent
RESULTS = EXPERIMENTS / "results" / "gpu"
for path in (str(EXPERIMENTS), str(ROOT)):  # bench_split, gpu_paper_config; this checkout's osdp
    if path not in sys.path:
        sys.path.insert(0, path)

from osdp.machine.identity import machine_info  # noqa: E402
from osdp.machine.timing import StepTimer  # noqa: E402
import bench_split  # noqa: E402
import gpu_paper_config  # noqa: E402

TARGETS = {
    "user_step_error_max": 0.15,  # osdp train's predicted step against its measured one
    "split_hidden_of_hideable_min": 0.80,  # per k
    "memory_error_median_max": 0.05,
    "memory_error_worst_max": 0.10,
    "time_limit_s": 540,
}
FAKE_PG = gpu_paper_config.NOTE
PARTS = ("tests", "paper_config", "user_path", "overlap", "flops", "mfu")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs: the GPU's sizes, or the dry run's tiny ones."""

    overlap: dict[str, Any]
    paper_argv: list[str]
    mfu_models: dict[str, int]  # model -> micro-batch (sequences of the model's length)
    mfu_steps: int
    mfu_warmup: int
    compile_backend: str
    compile_reserve_s: float  # seconds a compiled MFU run may need; skipped when less is left
    user_model: str  # osdp train's model, micro-batch, precision, steps and the budgets (fractions of DDP's peak)
    user_batch: int
    user_precision: str
    user_steps: int
    user_budget_fractions: tuple[float, ...]


GPU_SIZES = Sizes(
    overlap=dict(in_features=4096, out_features=16384, ks=(2, 4, 8), dtype=torch.bfloat16, rounds=10, warmup=2),
    paper_argv=["--model", "gpt-48l-h1536", "--world-size", "8", "--budget", "8GiB", "--extra-budgets", "6GiB",
                "4GiB", "--batch-sizes", "1", "2", "4", "8", "--steps", "3", "--warmup", "1"],
    mfu_models={"gpt2-small": 16, "gpt2-medium": 8},
    mfu_steps=10,
    mfu_warmup=3,
    compile_backend="inductor",
    compile_reserve_s=100.0,
    user_model="gpt2-small",
    user_batch=8,
    user_precision="bf16",
    user_steps=14,
    user_budget_fractions=(0.97, 0.93),  # DDP's peak to OSDP's least (0.92 on an H200)
)
DRY_SIZES = Sizes(
    overlap=dict(in_features=256, out_features=1024, ks=(2, 4, 8), dtype=torch.float32, tokens=256, rounds=2,
                 warmup=1),
    paper_argv=["--model", "gpt2-tiny", "--world-size", "8", "--budget", "5MiB", "--extra-budgets", "4MiB", "3MiB",
                "--batch-sizes", "4", "--steps", "1", "--warmup", "1"],
    mfu_models={"gpt2-tiny": 4, "llama-tiny": 4},  # two families, at sizes bf16 runs in seconds on a CPU
    mfu_steps=2,
    mfu_warmup=1,
    compile_backend="eager",  # dynamo's tracing, guarded like the GPU's; inductor's C++ build takes minutes on CPU
    compile_reserve_s=10.0,
    user_model="gpt2-tiny",
    user_batch=4,
    user_precision="fp32",  # the CPU's bf16 matmuls run 50x slower than its fp32 ones: the describe took 40 s
    user_steps=4,
    user_budget_fractions=(0.9,),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def slug(name: str, dry_run: bool) -> str:
    return "cpu-dry-run" if dry_run else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# --------------------------------------------------------------------------- 1. tests


def part_tests(dry_run: bool, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess (the dry run collects the tests without running them), over the test
    files that mark tests so (collecting every file imports what the whole suite imports)."""
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "mark.gpu" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *marked]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd += ["--collect-only"] if dry_run else [f"--junitxml={junit}"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        out = {"command": " ".join(["python", *cmd[1:]]).replace(f"--junitxml={junit}", "--junitxml=..."),
               "returncode": r.returncode, "ran": not dry_run, "output_tail": (r.stdout + r.stderr)[-3000:]}
        if dry_run:
            out["collected"] = [line for line in r.stdout.splitlines() if "::" in line]
            return out
        cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else []
    results = {}
    for case in cases:
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        results[test_id] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
    out.update(collected=list(results), results=results,
               passed=sum(v["outcome"] == "passed" for v in results.values()),
               failed=[k for k, v in results.items() if v["outcome"] in ("failure", "error")],
               skipped=[k for k, v in results.items() if v["outcome"] == "skipped"])
    return out


# --------------------------------------------------------------------------- 5. the user's path


def osdp_train(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """One ``osdp train`` job in a subprocess; its record (``--json``) with the command, time and output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        record_path = Path(tmp) / "train.json"
        cmd = [sys.executable, "-m", "osdp.cli", "train", *argv, "--json", str(record_path)]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            returncode, output = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            returncode, output = None, f"timed out after {timeout_s:.0f} s\n" + str(e.stdout or "")[-3000:]
        out: dict[str, Any] = {"command": "osdp train " + " ".join(argv), "returncode": returncode,
                               "seconds": time.perf_counter() - t0, "output_tail": output[-3000:]}
        if record_path.exists():
            out["record"] = json.loads(record_path.read_text())
    return out


def part_user_path(sizes: Sizes, device: torch.device, remaining: Callable[[], float]) -> dict[str, Any]:
    """``osdp train`` on one rank: DDP, then OSDP's searched plan at fractions of DDP's measured peak."""
    from osdp import models
    from osdp.machine.presets import datasheet_peak_flops

    config = models.get_config(sizes.user_model)
    peak_flops = (datasheet_peak_flops(device_name(device)) or {}).get("bfloat16")
    common = ["--device", device.type, "--nproc", "1", "--model", sizes.user_model, "--batch-size",
              str(sizes.user_batch), "--mixed-precision", sizes.user_precision, "--steps", str(sizes.user_steps),
              "--warmup", "2", "--data", "synthetic", "--log-every", "100"]
    out: dict[str, Any] = {"model": sizes.user_model, "batch_size": sizes.user_batch, "precision": sizes.user_precision,
                           "ranks": "one rank, " + ("NCCL" if device.type == "cuda" else "gloo"),
                           "mfu_reference": "data-sheet dense bf16 peak" if peak_flops else None, "runs": {}}

    def summarise(name: str, result: dict[str, Any], budget: int | None) -> dict[str, Any]:
        from osdp.schema.plan import Plan

        record = result.pop("record", None)
        result["budget_bytes"] = budget
        if record:
            rank0 = record["per_rank"][0]
            plan = Plan.from_dict(record["plan"])
            tokens_per_s = rank0["tokens_per_s"]
            result.update(
                plan=plan.summary(), plan_units={u.path: u.label for u in plan.units},
                predicted_step_s=record["predicted_step_s"], measured_step_s=record["measured_step_s"],
                predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=rank0["peak_bytes"],
                tokens_per_s=tokens_per_s,
                mfu=models.flops_per_token(config) * tokens_per_s / peak_flops if peak_flops else None,
                losses=rank0["losses"])
            if result["predicted_step_s"]:
                result["step_error"] = result["predicted_step_s"] / result["measured_step_s"] - 1
            if result["predicted_peak_bytes"] and result["measured_peak_bytes"]:
                result["peak_error"] = result["predicted_peak_bytes"] / result["measured_peak_bytes"] - 1
            if budget and result["measured_peak_bytes"]:
                result["within_budget"] = result["measured_peak_bytes"] <= budget
        out["runs"][name] = result
        print(f"gpu_check: user_path {name}: " + ", ".join(
            f"{k} {result[k]}" for k in ("returncode", "seconds", "predicted_step_s", "measured_step_s",
                                         "predicted_peak_bytes", "measured_peak_bytes") if k in result), flush=True)
        return result

    ddp = summarise("ddp", osdp_train(common + ["--strategy", "ddp"], timeout_s=min(180.0, max(30.0, remaining() - 20))), None)
    ddp_peak = ddp.get("measured_peak_bytes")
    if not ddp_peak:
        raise RuntimeError("osdp train --strategy ddp gave no peak: " + ddp["output_tail"][-1500:])
    for fraction in sizes.user_budget_fractions:
        if remaining() < 40:
            out["runs"][f"osdp@{fraction:.2f}"] = {"skipped": f"{remaining():.0f} s left of the time limit"}
            continue
        budget = int(ddp_peak * fraction) // 2**20 * 2**20
        summarise(f"osdp@{fraction:.2f}", osdp_train(common + ["--device-mem", f"{budget // 2**20}MiB"],
                                                     timeout_s=min(180.0, max(30.0, remaining() - 20))), budget)
    return out


# --------------------------------------------------------------------------- 2. overlap


def part_overlap(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    return bench_split.stand_in_overlap(device, **sizes.overlap)


# --------------------------------------------------------------------------- 3 and 4. the paper's configuration


def part_paper_config(sizes: Sizes, device: torch.device, out: Path, stem: str) -> dict[str, Any]:
    """gpu_paper_config with every plan and the measured compute; its full record and figure beside ours."""
    args = gpu_paper_config.parse_args([*sizes.paper_argv, "--device", device.type, "--plans", "all",
                                        "--measured-compute", "--out", str(out)])
    record = gpu_paper_config.experiment(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.paper_config.json").write_text(json.dumps(record, indent=1, default=str))
    gpu_paper_config.plot(record, out / f"{stem}.paper_config.png")
    return record


def memory_summary(record: dict[str, Any]) -> dict[str, Any]:
    """Per plan predicted against measured peak; median and worst error; plans over their budget."""
    plans, errors = {}, []
    for r in record["runs"]:
        error = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
        errors.append(abs(error))
        plans[r["name"]] = {
            "summary": r["summary"], "batch_size": r["batch_size"], "budget_bytes": r["budget_bytes"],
            "predicted_peak_bytes": r["predicted_peak_bytes"], "measured_peak_bytes": r["peak_bytes"],
            "measured_reserved_bytes": r.get("peak_reserved_bytes"), "error": error,
            "measured_baseline_bytes": r.get("baseline_bytes"), "leftover_bytes": r.get("leftover_bytes"),
            "over_budget": bool(r["budget_bytes"]) and r["peak_bytes"] > r["budget_bytes"],
            "measured_compute_s": r["step_s_median"], "predicted_compute_s": r.get("predicted_compute_s"),
            "predicted_compute_analytic_s": r["predicted_compute_analytic_s"],
            "predicted_step_with_collectives_s": r["predicted_step_s"],
        }
    MiB = 2**20
    paper = {name: {"measured_mib": plans[name]["measured_peak_bytes"] / MiB, "paper_mb": record["paper"][key]}
             for name, key in (("osdp", "osdp_peak_mb"), ("fsdp", "fsdp_peak_mb")) if name in plans}
    return {
        "paper_config": plans,
        "memory_error_median": statistics.median(errors) if errors else None,
        "memory_error_worst": max(errors) if errors else None,
        "over_budget": [name for name, p in plans.items() if p["over_budget"]],
        "not_fitting": record.get("not_fitting", []),
        "paper_comparison": paper,
    }


def compute_summary(plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Kendall tau and errors of the predicted compute step (measured and analytic descriptions)."""
    from osdp.cli.validate import kendall_tau

    out: dict[str, Any] = {}
    for key, label in (("predicted_compute_s", "measured"), ("predicted_compute_analytic_s", "analytic")):
        rows = [(p[key], p["measured_compute_s"]) for p in plans.values() if p.get(key)]
        if len(rows) < 2:
            continue
        predicted, measured = zip(*rows)
        errors = [abs(a / b - 1) for a, b in rows]
        out[label] = {"kendall_tau": kendall_tau(predicted, measured), "error_median": statistics.median(errors),
                      "error_worst": max(errors), "plans": len(rows)}
    return out


# --------------------------------------------------------------------------- 4b. FLOP/s presets


def preset_for(name: str) -> str | None:
    """The osdp.machine preset describing a GPU of this name (the CPU's for the CPU)."""
    if name == "cpu":
        return "cpu-loopback"
    for key, preset in (("A100", "a100-80gb-nvlink"), ("V100", "v100-32gb-nvlink"), ("H100", "h100-nvlink"),
                        ("H200", "h100-nvlink")):  # H200: H100 SXM's compute, more memory
        if key in name:
            return preset
    return None


def part_flops(device: torch.device) -> dict[str, Any]:
    """Matmul FLOP/s measured here against the preset's (data sheet x MFU_FRACTION) and the data sheet."""
    from osdp.machine.measure import measure_flops
    from osdp.machine.presets import DEVICE_PRESETS, MFU_FRACTION, datasheet_peak_flops

    name = device_name(device)
    preset = preset_for(name)
    peaks = datasheet_peak_flops(name) or {}
    out: dict[str, Any] = {"preset": preset, "mfu_fraction": MFU_FRACTION,
                           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype).removeprefix("torch.")
        measured = measure_flops(device, dtype)
        row = {"measured": measured, "preset": None, "measured_over_preset": None,
               "datasheet_peak": peaks.get(key), "measured_over_peak": None}
        if preset and key in DEVICE_PRESETS[preset].flops:
            row["preset"] = DEVICE_PRESETS[preset].flops[key]
            row["measured_over_preset"] = measured / row["preset"]
        if row["datasheet_peak"]:
            row["measured_over_peak"] = measured / row["datasheet_peak"]
        out[key] = row
    return out


# --------------------------------------------------------------------------- 5. MFU


def train_throughput(model_name: str, batch: int, device: torch.device, backend: str | None, steps: int,
                     warmup: int) -> dict[str, Any]:
    """Tokens/s of bf16 autocast training (fp32 weights, AdamW) of a reference model on one device."""
    from osdp import models
    from osdp.models.data import synthetic_batch

    torch.manual_seed(0)
    config = models.get_config(model_name)
    with torch.device(device):
        model = models.build(model_name)
    inputs, targets = (t.to(device) for t in synthetic_batch(config, batch, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model, backend=backend) if backend else model

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    _sync(device)
    start = time.perf_counter()
    step()  # compiles, when compiled
    _sync(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        with StepTimer(device) as timer:
            loss = step()
        times.append(timer.seconds)
    peak = None
    if device.type == "cuda":  # (on CPU the live-bytes tracker would trace into the compiled graph)
        from osdp.machine.memory import PeakMemory

        with PeakMemory(device) as meter:
            step()
        peak = meter.stats().peak_bytes
    step_s = statistics.median(times)
    tokens = batch * config.seq_len
    out = {"batch_size": batch, "seq_len": config.seq_len, "params": models.num_params(model),
           "flops_per_token": models.flops_per_token(config), "step_s": step_s, "step_times_s": times,
           "tokens_per_s": tokens / step_s, "first_step_s": first_s, "final_loss": loss.item(),
           "peak_bytes": peak, "compile_backend": backend}
    del run, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def part_mfu(sizes: Sizes, device: torch.device, remaining: Callable[[], float], flops: dict | None) -> dict[str, Any]:
    from osdp.machine.measure import measure_flops
    from osdp.machine.presets import datasheet_peak_flops

    peak = (datasheet_peak_flops(device_name(device)) or {}).get("bfloat16")
    reference = "data-sheet dense bf16 peak"
    if peak is None:  # no data sheet (the CPU): this device's own bf16 matmul rate
        peak = (flops or {}).get("bfloat16", {}).get("measured") or measure_flops(device, torch.bfloat16)
        reference = "this device's measured bf16 matmul FLOP/s (no data sheet)"
    out: dict[str, Any] = {"peak_flops": peak, "reference": reference, "models": {}}
    for model_name, batch in sizes.mfu_models.items():
        modes: dict[str, Any] = {}
        for mode, backend in (("eager", None), ("compiled", sizes.compile_backend)):
            if backend and remaining() < sizes.compile_reserve_s:
                modes[mode] = {"skipped": f"{remaining():.0f} s left of the time limit, a compiled run may need "
                                          f"{sizes.compile_reserve_s:.0f} s"}
                continue
            try:
                r = train_throughput(model_name, batch, device, backend, sizes.mfu_steps, sizes.mfu_warmup)
            except Exception as e:  # noqa: BLE001 - torch.compile may fail on a given torch/GPU: say so, go on
                modes[mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                continue
            r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
            modes[mode] = r
        out["models"][model_name] = modes
    return out


# --------------------------------------------------------------------------- the record


def targets_met(record: dict[str, Any]) -> dict[str, Any]:
    """Each target: met or not (the dry run's overlap and time mean nothing, so they are not judged)."""
    t: dict[str, Any] = {}
    tests = record.get("tests") or {}
    if tests.get("ran"):
        t["tests_pass"] = tests.get("returncode") == 0 and not tests.get("failed")
    user_runs = [r for r in ((record.get("user_path") or {}).get("runs") or {}).values() if "step_error" in r]
    if user_runs:  # the searched plans (the DDP run has no prediction: osdp train --strategy does not price)
        t["user_path_step_within_15pct"] = all(abs(r["step_error"]) <= TARGETS["user_step_error_max"]
                                               for r in user_runs)
        t["user_path_within_budget"] = all(r.get("within_budget", False) for r in user_runs)
    hideable = record.get("split_hidden_of_hideable") or {}
    if hideable and not record["dry_run"]:
        t["split_overlap"] = all(v >= TARGETS["split_hidden_of_hideable_min"] for v in hideable.values())
    if record.get("memory_error_median") is not None:
        t["memory_error_median"] = record["memory_error_median"] <= TARGETS["memory_error_median_max"]
        t["memory_error_worst"] = record["memory_error_worst"] <= TARGETS["memory_error_worst_max"]
        t["no_plan_over_budget"] = not record["over_budget"]
    if not record["dry_run"]:
        t["time_limit"] = record["seconds"] <= TARGETS["time_limit_s"]
    return t


def software(device: torch.device) -> dict[str, Any]:
    """The CUDA toolkit, driver, torch build and GPU a result was measured with."""
    out: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
    for key, cmd in (("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                     "--format=csv,noheader"]), ("nvcc", ["nvcc", "--version"])):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            out[key] = (r.stdout.strip().splitlines() or [""])[-1] if key == "nvcc" else r.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out[key] = f"not available ({type(e).__name__})"
    return out


def run_all(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] = lambda record: None) -> dict[str, Any]:
    """Every part in turn; ``save`` gets the record after each, so what finished is kept if the run is stopped."""
    start = time.perf_counter()
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device here; --dry-run checks the script on the CPU")
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    name = device_name(device)
    stem = slug(name, args.dry_run)
    remaining = lambda: args.time_limit - (time.perf_counter() - start)  # noqa: E731
    record: dict[str, Any] = {
        "device": name, "dry_run": args.dry_run, "torch": torch.__version__, "cuda": torch.version.cuda,
        "machine": {**machine_info(device), "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory
                    if device.type == "cuda" else None},
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "software": software(device),
        "notes": [
            "one GPU: multi-rank code runs on a one-rank group, or as rank 0 of 8 under the fake process group "
            f"({FAKE_PG})",
            "split overlap: the op's collectives are replaced by a stand-in, copies of each slice from pinned host "
            "memory (and of each weight-gradient slice to it) on the op's communication stream; the op cannot "
            "hide slice 0's gather, so at most (k-1)/k of the gather time can hide: the target is judged on "
            "hidden_of_hideable",
        ] + (["dry run: CPU, tiny sizes; no streams on CPU, so its overlap and timings mean nothing"]
             if args.dry_run else []),
        "parts": {},
    }

    def part(key: str, fn: Callable[[], Any], reserve_s: float = 20.0) -> Any:
        if key not in args.parts:
            return None
        if remaining() < reserve_s:
            record["parts"][key] = {"seconds": 0.0, "skipped": f"{remaining():.0f} s left of the time limit, the "
                                                               f"part needs about {reserve_s:.0f} s"}
            print(f"gpu_check: {key} skipped ({remaining():.0f} s left)", flush=True)
            return None
        t0 = time.perf_counter()
        print(f"gpu_check: {key} ({remaining():.0f} s left)", flush=True)
        try:
            result = fn()
            record["parts"][key] = {"seconds": time.perf_counter() - t0}
            return result
        except Exception as e:  # noqa: BLE001 - record it, run the other parts
            record["parts"][key] = {"seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()[-4000:]}
            print(f"gpu_check: {key} failed: {type(e).__name__}: {e}", flush=True)
            return None
        finally:  # what a part leaves behind must not count in the next one's peak memory
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            record["seconds"] = time.perf_counter() - start
            save(record)

    record["tests"] = part("tests", lambda: part_tests(args.dry_run, timeout_s=max(60.0, min(150.0, remaining()))))
    overlap = part("overlap", lambda: part_overlap(sizes, device))
    if overlap:
        record["split_overlap"] = overlap
        record["split_hidden_fraction"] = {k: v["hidden_fraction"] for k, v in overlap["per_k"].items()}
        record["split_hidden_of_hideable"] = {k: v["hidden_of_hideable"] for k, v in overlap["per_k"].items()}
        record["split_step_vs_linear"] = {k: v["step_vs_linear"] for k, v in overlap["per_k"].items()}
    paper = part("paper_config", lambda: part_paper_config(sizes, device, args.out, stem), reserve_s=60.0)
    if paper:
        record.update(memory_summary(paper))
        record["compute"] = compute_summary(record["paper_config"])
        record["compute_kendall_tau"] = record["compute"].get("measured", {}).get("kendall_tau")
        record["paper_config_setting"] = {k: paper[k] for k in ("model", "world_size", "rank", "seq_len",
                                                               "mixed_precision", "preset", "budget_bytes", "note")}
    record["user_path"] = part("user_path", lambda: part_user_path(sizes, device, remaining), reserve_s=60.0)
    record["flops"] = part("flops", lambda: part_flops(device))
    mfu = part("mfu", lambda: part_mfu(sizes, device, remaining, record["flops"]))
    if mfu:
        record["mfu_reference"] = {"peak_flops": mfu["peak_flops"], "reference": mfu["reference"]}
        record["mfu"] = {m: {mode: r.get("mfu") for mode, r in modes.items()} for m, modes in mfu["models"].items()}
        record["training"] = mfu["models"]
    record["seconds"] = time.perf_counter() - start
    record["targets"] = targets_met(record)
    save(record)
    return record


# --------------------------------------------------------------------------- the report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(record: dict[str, Any]) -> str:
    out = [f"# GPU proof: {record['device']}" + (" (dry run)" if record["dry_run"] else ""), "",
           f"torch {record['torch']}, CUDA {record['cuda']}, {record['date']}, {record['seconds']:.0f} s "
           "(`python experiments/gpu_check.py`).", ""]
    sw = record.get("software") or {}
    if sw:
        out += [f"Software: torch {sw.get('torch')} (CUDA {sw.get('torch_cuda')}, cuDNN {sw.get('cudnn')}, NCCL "
                f"{sw.get('nccl')}); GPU and driver: {sw.get('nvidia_smi')}; toolkit: {sw.get('nvcc')}.", ""]
    out += [f"- {n}" for n in record["notes"]] + [""]
    out += ["## Targets", "", _table(["check", "met"], [[k, "yes" if v else "**no**"] for k, v in record["targets"].items()]), ""]
    errors = {k: v["error"] for k, v in record["parts"].items() if "error" in v}
    if errors:
        out += ["Parts that failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()), ""]
    skipped = {k: v["skipped"] for k, v in record["parts"].items() if "skipped" in v}
    if skipped:
        out += ["Parts skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()), ""]
    tests = record.get("tests")
    if tests:
        out += ["## 1. GPU tests", "", f"`{tests['command']}`: "
                + (f"{tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped"
                   if tests["ran"] else f"collected {len(tests['collected'])} (dry run: not run)"), ""]
        out += [f"- {t}" + (f": {tests['results'][t]['outcome']}" if tests["ran"] else "") for t in tests["collected"]]
        out.append("")
    user = record.get("user_path")
    if user:
        out += ["## The user's path: `osdp train`", "",
                f"{user['model']}, micro-batch {user['batch_size']}, {user['precision']}, {user['ranks']}; "
                f"MFU against the {user['mfu_reference'] or 'no data sheet: not computed'}.", "",
                _table(["run", "plan", "budget MiB", "predicted ms", "measured ms", "step error", "predicted MiB",
                        "measured MiB", "peak error", "tokens/s", "MFU"],
                       [[name, r.get("plan", r.get("skipped") or f"failed ({r.get('returncode')})"),
                         _mib(r.get("budget_bytes")),
                         "-" if r.get("predicted_step_s") is None else f"{r['predicted_step_s'] * 1e3:.1f}",
                         "-" if r.get("measured_step_s") is None else f"{r['measured_step_s'] * 1e3:.1f}",
                         _pct(r.get("step_error")), _mib(r.get("predicted_peak_bytes")),
                         _mib(r.get("measured_peak_bytes")), _pct(r.get("peak_error")),
                         f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-", _pct(r.get("mfu"))]
                        for name, r in user["runs"].items()]), ""]
        out += [f"- `{r['command']}`" for r in user["runs"].values() if "command" in r] + [""]
    overlap = record.get("split_overlap")
    if overlap:
        out += ["## 2. Split op: overlap of the gathers (stand-in)", "",
                f"{overlap['layer']}, {overlap['dtype']}, {overlap['tokens']} tokens, {overlap['timer']}. "
                f"Stand-in: {overlap['stand_in']}", "",
                _table(["k", "hidden", "hidden of hideable", "gather ms", "matmuls ms", "forward ms", "step ms",
                        "vs Linear", "vs unsplit gathered", "matches Linear"],
                       [[k, _pct(v["hidden_fraction"]), _pct(v["hidden_of_hideable"]), f"{v['gather_s'] * 1e3:.2f}",
                         f"{v['compute_s'] * 1e3:.2f}", f"{v['split_forward_s'] * 1e3:.2f}",
                         f"{v['split_step_s'] * 1e3:.2f}", f"{v['step_vs_linear']:.2f}",
                         f"{v['step_vs_unsplit_gathered']:.2f}", v["matches_linear"]]
                        for k, v in overlap["per_k"].items()]), ""]
    if record.get("paper_config"):
        s = record["paper_config_setting"]
        out += ["## 3. The paper's configuration: memory", "",
                f"{s['model']}, rank {s['rank']} of {s['world_size']} ({s['note']}), {s['mixed_precision']}, "
                f"sequence {s['seq_len']}. Median error {_pct(record['memory_error_median'])}, worst "
                f"{_pct(record['memory_error_worst'])}; over budget: {record['over_budget'] or 'none'}.", "",
                _table(["plan", "micro-batch", "budget MiB", "predicted MiB", "measured MiB", "error", "summary"],
                       [[n, p["batch_size"], _mib(p["budget_bytes"]), _mib(p["predicted_peak_bytes"]),
                         _mib(p["measured_peak_bytes"]), _pct(p["error"]), p["summary"]]
                        for n, p in record["paper_config"].items()]), ""]
        for x in record["not_fitting"]:
            out.append(f"- {x['name']}: {x['error']}")
        for n, p in record["paper_comparison"].items():
            out.append(f"- {n}: {p['measured_mib']:,.0f} MiB measured; the paper: {p['paper_mb']} MB")
        out += ["", "## 4. Compute (no communication under the fake group)", "",
                _table(["plan", "measured ms", "predicted ms (measured description)", "predicted ms (analytic)"],
                       [[n, f"{p['measured_compute_s'] * 1e3:.1f}",
                         "-" if p["predicted_compute_s"] is None else f"{p['predicted_compute_s'] * 1e3:.1f}",
                         f"{p['predicted_compute_analytic_s'] * 1e3:.1f}"] for n, p in record["paper_config"].items()]),
                ""]
        for label, c in record["compute"].items():
            out.append(f"- {label} description: Kendall tau {c['kendall_tau']:.2f}, error median "
                       f"{_pct(c['error_median'])}, worst {_pct(c['error_worst'])} over {c['plans']} plans")
        out.append("")
    flops = record.get("flops")
    if flops:
        out += ["## 4b. Matmul FLOP/s against the presets", "",
                _table(["dtype", "measured TFLOP/s", f"preset {flops['preset']}", "measured / preset",
                        "data sheet", "measured / data sheet"],
                       [[k, f"{v['measured'] / 1e12:.3g}", "-" if v["preset"] is None else f"{v['preset'] / 1e12:.3g}",
                         "-" if v["measured_over_preset"] is None else f"{v['measured_over_preset']:.2f}",
                         "-" if v["datasheet_peak"] is None else f"{v['datasheet_peak'] / 1e12:.0f}",
                         _pct(v["measured_over_peak"])]
                        for k, v in flops.items() if isinstance(v, dict)]), ""]
    if record.get("training"):
        ref = record["mfu_reference"]
        out += ["## 5. One GPU's limit: bf16 training", "",
                f"MFU against {ref['reference']}: {ref['peak_flops'] / 1e12:.3g} TFLOP/s.", "",
                _table(["model", "mode", "micro-batch", "tokens/s", "MFU", "step ms", "first step s", "peak MiB"],
                       [[m, mode, r.get("batch_size", "-"), f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else
                         r.get("skipped") or r.get("error"), _pct(r.get("mfu")),
                         f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-",
                         f"{r['first_step_s']:.1f}" if "first_step_s" in r else "-", _mib(r.get("peak_bytes"))]
                        for m, modes in record["training"].items() for mode, r in modes.items()]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes: check the script, not the GPU")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    p.add_argument("--time-limit", type=float, default=TARGETS["time_limit_s"] - 30,
                   help="seconds for the whole run; compiled MFU runs are skipped when too little is left")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"output folder (default {RESULTS.relative_to(ROOT)})")
    args = p.parse_args(argv)

    def save(record: dict[str, Any]) -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = slug(record["device"], args.dry_run)
        record["targets"] = targets_met(record)
        (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(record) + "\n")

    record = run_all(args, save)
    stem = slug(record["device"], args.dry_run)
    print(markdown(record))
    print(f"gpu_check: wrote {args.out / stem}.json and .md in {record['seconds']:.0f} s", flush=True)
    failed = [k for k, v in record["parts"].items() if "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
