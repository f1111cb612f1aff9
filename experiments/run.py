"""One experiment part: a reference model on N data-parallel ranks, baselines and OSDP at budgets -> JSON records.

    python experiments/run.py --model gpt2-mini --strategy fsdp2+ac --json fsdp2-ac.json
    python experiments/run.py --model gpt2-mini --budget 60MiB --link gpu-ratio --json osdp.json
    python experiments/run.py --probe-link gpu-ratio     # the link's fitted collectives; nothing is trained

Strategies (a record's ``strategy``):

- the baselines of ``baselines.py`` (``BASELINES``): ``torch-ddp``,
  ``fsdp2``, ``fsdp2-zero2`` and each ``+ac``, built as users write them,
  without OSDP's planner;
- ``osdp`` at a budget: what ``osdp.wrap(model, device_mem=B,
  example_input=...)`` plans (the same ``describe`` call and
  ``planner.search``, on the collectives measured on this run's process
  group); every budget is its own run, also where two budgets get one plan;
- ``osdp-uniform-ddp``, ``osdp-uniform-zero2``, ``osdp-uniform-fsdp``: OSDP's
  own uniform plans (its units and ``apply_plan``, one mode everywhere), an
  ablation, not a baseline;
- ``osdp-replicate``, ``osdp-zero3``, ``osdp-zero2`` and each ``+ac``: the
  native twins' OSDP counterparts for ``bench_modes.py`` (``TWINS``): one
  mode everywhere at the unit granularity the search picks for it, with
  ``+ac`` the units inside the transformer blocks checkpointed;
- ``fairscale``: fairscale's FSDP, ZeRO-3 with one FSDP instance per OSDP
  unit; CUDA only (its FSDP uses CUDA streams unconditionally).

Measurement. Every run of a part lives in one process group. Each of
``rounds`` repeats is one ``osdp.harness.run_jobs`` over all runs (every
model alive, one step of each in turn, so all see the same load; the order
rotates between repeats): 2 warm-up steps, then at least ``min_steps`` (20)
timed steps, then one step under ``osdp.memory.PeakMemory``. A step takes as
long as its slowest rank; a repeat's step time is the median over its steps;
a run's peak is the largest over ranks and repeats (on CPU, ``osdp.memory``
counts DDP's gradient buckets from DDP's own record of them). The
compute-only run, the plain model on every rank with the same micro-batch and
no communication, takes its turns too: a run's ``efficiency`` is its step time
over the compute-only one, the median over repeats of the ratio within a
repeat (the physical limit is 1.0).

Every reduction is a reduce-scatter of ``osdp.comm`` (``reduce_scatter`` in
the spec, default ``pairwise``: NCCL's traffic on gloo), for every strategy
alike; the result says which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from baselines import BASELINES  # noqa: E402

# OSDP's uniform plans (an ablation): strategy -> osdp.strategy_plan's name
ABLATIONS = {"osdp-uniform-ddp": "ddp", "osdp-uniform-zero2": "zero2", "osdp-uniform-fsdp": "fsdp"}
# OSDP's uniform plans beside their native twins (bench_modes.py): mode, and checkpointing of the units in
# the transformer blocks as the "+ac" baselines checkpoint each block; at the unit granularity OSDP's
# search picks for that mode when memory is no limit
TWINS = {
    f"osdp-{mode}{'+ac' if ac else ''}": (mode, ac) for mode in ("replicate", "zero3", "zero2") for ac in (False, True)
}
EXTRA_STRATEGIES = ("fairscale",)
STRATEGIES = (*BASELINES, *ABLATIONS, *TWINS, *EXTRA_STRATEGIES)
COMPUTE_ONLY = "compute-only"  # the plain model, no communication: the efficiency reference
MIN_STEPS = 20  # timed steps per run and repeat, at least
DEFAULT_REDUCE_SCATTER = "pairwise"  # osdp.comm: NCCL's traffic on gloo, for every strategy alike
# The GPU node whose compute-to-communication ratio the shaped link reproduces: osdp.device's
# h100-nvlink preset, achievable bf16 FLOP/s (45% of 989 TFLOP/s) over all-gather busbw (360 GB/s).
GPU_RATIO_PRESET = "h100-nvlink"
DEFAULT_PORT = 29531


def gpu_flop_per_byte(preset: str = GPU_RATIO_PRESET) -> float:
    from osdp.device import DEVICE_PRESETS

    p = DEVICE_PRESETS[preset]
    return p.flops["bfloat16"] / p.bus_bandwidth["all_gather"]


def core_flops(repeats: int = 5) -> float:
    """This machine's fp32 matmul FLOP/s on one thread: the best of a few ``osdp.device.measure_flops``
    (the best, because other work on a shared machine only ever slows a measurement down)."""
    import torch

    from osdp.device import measure_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return max(measure_flops("cpu", time_budget_s=0.3) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


def resolve_link(name: str, *, flops: float | None = None, ratio: float | None = None) -> dict[str, Any]:
    """``loopback``; ``gpu-ratio`` (veth + tbf at the rate giving this core's FLOP/s / bytes/s = the GPU
    node's ratio); or ``tbf:RATE`` with RATE like 600mbit."""
    if name == "loopback":
        return {"name": "loopback", "kind": "loopback", "label": "loopback (gloo over 127.0.0.1)"}
    if name == "gpu-ratio":
        flops = flops or core_flops()
        ratio = ratio or gpu_flop_per_byte()
        rate = netns.rate_for_ratio(flops, ratio)
        return {
            "name": "gpu-ratio", "kind": "veth", "rate_bit_per_s": rate,
            "target_flop_per_byte": ratio, "core_flops": flops, "ratio_of": GPU_RATIO_PRESET,
            "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s ({ratio:.0f} FLOP/byte, as {GPU_RATIO_PRESET})",
        }
    if name.startswith("tbf:"):
        text = name[4:].lower()
        for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
            if text.endswith(suffix):
                rate = int(float(text[: -len(suffix)]) * mult)
                break
        else:
            raise ValueError(f"link rate {text!r}: use e.g. tbf:600mbit")
        return {"name": name, "kind": "veth", "rate_bit_per_s": rate, "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s"}
    raise ValueError(f"unknown link {name!r}: loopback, gpu-ratio or tbf:RATE")


# --------------------------------------------------------------------------- the worker (every rank)


def run_fairscale(build, batch, *, device, time_budget_s: float, measure_memory: bool, unit_paths,
                  warmup: int = 2, min_steps: int = MIN_STEPS, max_steps: int = 200) -> dict[str, Any]:
    """Collective: fairscale's FSDP (ZeRO-3, one instance per OSDP unit): warm-up, timed steps, one peak step."""
    from osdp.distributed import all_gather_objects
    from osdp.memory import PeakMemory
    from osdp.optim import make_optimizer
    from osdp.timing import StepTimer

    if device.type != "cuda":
        raise RuntimeError("fairscale FSDP needs CUDA (it uses CUDA streams unconditionally)")
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    model = build().to(device)
    for path in sorted((p for p in unit_paths if p), key=lambda p: -p.count(".")):  # innermost first
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, FairscaleFSDP(getattr(parent, leaf), reshard_after_forward=True))
    model = FairscaleFSDP(model, reshard_after_forward=True)
    opt = make_optimizer("adamw", model.parameters())
    inputs, targets = batch

    def step() -> tuple[float, float]:
        with StepTimer(device) as timer:
            model(inputs, targets).backward()
            fwd_bwd = timer.lap()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return timer.seconds, fwd_bwd

    warm = [step() for _ in range(warmup)]
    wanted = int(time_budget_s / max(warm[-1][0], 1e-6))
    n = max(min_steps, min(max_steps, max(all_gather_objects(wanted))))
    timed = [step() for _ in range(n)]
    out: dict[str, Any] = {"step_s": [t for t, _ in timed], "fwd_bwd_s": [f for _, f in timed]}
    if measure_memory:
        with PeakMemory(device, model, opt) as meter:
            step()
        stats = meter.stats()
        out.update(peak_bytes=stats.peak_bytes, peak_breakdown=dict(stats.peak_breakdown))
    del model, opt
    return out


def block_list_path(model) -> str:
    """Module path of the model's transformer block list (``baselines.transformer_blocks``)."""
    from baselines import transformer_blocks

    blocks = transformer_blocks(model)
    return next(path for path, m in model.named_modules() if m is blocks)


def twin_plan(descriptions, mode: str, ac: bool, blocks: str, device_info, calibration, optimizer: str,
              settings: dict):
    """OSDP's plan with every unit in ``mode`` (checkpointing the units inside the blocks with ``ac``), at
    the granularity whose plan the cost model predicts faster: what its search picks when memory is no limit."""
    from osdp.cost import predict
    from osdp.plan import Plan, UnitPlan

    best = None
    for d in descriptions:
        plan = Plan([UnitPlan(u.path, mode, checkpoint=ac and u.path.startswith(blocks + "."))
                     for u in d.units], **settings)
        plan.meta["granularity"] = d.granularity
        step = predict(d, plan, device_info, optimizer=optimizer, calibration=calibration).step_s
        if best is None or step < best[0]:
            best = (step, plan)
    return best[1]


def param_fraction(description, plan, mode: str) -> float:
    """Share of the parameter bytes that ``plan`` puts in ``mode``."""
    total = sum(u.param_bytes for u in description.units) or 1
    by_path = {u.path: u.mode for u in plan.units}
    return sum(u.param_bytes for u in description.units if by_path.get(u.path, "zero3") == mode) / total


def auto_budgets(low: int, high: int, count: int) -> list[int]:
    """``count`` budgets from ``low`` to ``high`` inclusive, evenly spaced, rounded up to KiB."""
    if count <= 1 or high <= low:
        return [-(-high // 1024) * 1024]
    return sorted({-(-int(low + (high - low) * i / (count - 1)) // 1024) * 1024 for i in range(count)})


def work(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Collective (every rank, under torchrun): the runs of ``spec``; rank 0 returns the result."""
    import functools
    import warnings

    import torch
    import torch.distributed as dist

    import osdp
    from baselines import build_baseline
    from osdp import comm, models
    from osdp.calibration import calibrate
    from osdp.cost import build_problem, predict
    from osdp.data import synthetic_batch
    from osdp.device import measure_device
    from osdp.distributed import all_gather_objects, broadcast_object, init_from_env
    from osdp.harness import Job, run_jobs
    from osdp.log import Progress
    from osdp.machine import machine_info
    from osdp.plan import Plan
    from osdp.planner import planning_descriptions, search
    from osdp.search import BudgetTooSmall, min_peak
    from osdp.units import structure_signature

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    reduce_scatter = spec.get("reduce_scatter", DEFAULT_REDUCE_SCATTER)
    comm.set_reduce_scatter(reduce_scatter)  # before anything measures or wraps
    device = init_from_env(spec.get("device", "auto"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_name, b = spec["model"], int(spec["batch_size"])
    overrides = {"seq_len": spec["seq_len"]} if spec.get("seq_len") else {}
    config = models.get_config(model_name, **overrides)
    seq_len = config.seq_len
    tokens = b * seq_len
    link = dict(spec.get("link") or {"name": "loopback", "kind": "loopback"})
    say = Progress(f"run {model_name} {link.get('name')}")
    started = time.perf_counter()

    def build():
        torch.manual_seed(0)  # every rank builds the same initial model
        return models.build(model_name, **overrides)

    g = torch.Generator().manual_seed(1000 + rank)
    batch = tuple(t.to(device) for t in synthetic_batch(config, b, generator=g))

    if spec.get("link_probe"):  # only the link: how fast gloo's collectives are over it
        say(f"measuring collectives ({reduce_scatter} reduce-scatter) and FLOP/s on the live group")
        device_info = broadcast_object(measure_device(time_budget_s=float(spec.get("collective_time_s", 3.0))))
        return {"device_info": device_info.to_dict(), "reduce_scatter": reduce_scatter} if rank == 0 else None
    if spec.get("calibrate"):  # this link's calibration, in its own run before the measured ones
        machine = calibrate(device, force=spec["calibrate"] == "force")
        return {"calibration": machine.to_dict(), "summary": machine.summary()} if rank == 0 else None
    # what osdp.wrap plans with: this job's calibration, measured by an earlier run (spec "calibrate")
    machine = calibrate(device, measure=False)
    device_info, calibration = machine.device_info, machine.calibration
    say(machine.summary())
    model = build().to(device)
    say("describing the model as osdp.plan does (rank 0; cached in OSDP_CACHE_DIR), at each unit granularity")
    descriptions = planning_descriptions(model, batch)  # the search chooses between them
    description = descriptions[0]
    blocks = block_list_path(model)
    signature = structure_signature(model)
    del model

    settings = dict(batch_size=b, world_size=world_size, model_signature=signature)
    optimizer = "adamw"

    def described(plan: Plan):
        return next(d for d in descriptions if set(d.paths) == set(plan.paths) | {""})

    def predicted(plan: Plan) -> dict[str, Any]:
        p = predict(described(plan), plan, device_info, optimizer=optimizer, calibration=calibration)
        return {"predicted_step_s": p.step_s, "predicted_peak_bytes": p.peak_bytes,
                "predicted_tokens_per_s": tokens / p.step_s}

    # ---- what to run: key -> Job (or "fairscale"); requests: one record each
    runs: dict[str, Any] = {}
    requests: list[dict[str, Any]] = []
    for s in spec.get("strategies", []):
        if s in BASELINES:
            runs[s] = Job(build, None, batch, parallelize=functools.partial(build_baseline, s, device_type=device.type))
            requests.append({"strategy": s, "key": s})
        elif s in ABLATIONS:
            plan = osdp.strategy_plan(build(), ABLATIONS[s], **settings)
            runs[s] = Job(build, plan, batch)
            requests.append({"strategy": s, "key": s, "plan": plan})
        elif s in TWINS:
            mode, ac = TWINS[s]
            plan = twin_plan(descriptions, mode, ac, blocks, device_info, calibration, optimizer, settings)
            runs[s] = Job(build, plan, batch)
            requests.append({"strategy": s, "key": s, "plan": plan})
        elif s == "fairscale":
            if device.type != "cuda":
                requests.append({"strategy": s, "key": None,
                                 "status": "skipped: fairscale FSDP needs CUDA (it uses CUDA streams unconditionally)"})
                continue
            runs[s] = "fairscale"
            requests.append({"strategy": s, "key": s})
        else:
            raise ValueError(f"unknown strategy {s!r}; use one of {', '.join(STRATEGIES)}")
    runs[COMPUTE_ONLY] = Job(build, None, batch)

    rounds = int(spec.get("rounds", 3))
    per_run_s = float(spec.get("time_per_run_s", 1.5))
    min_steps = int(spec.get("min_steps", MIN_STEPS))
    jobs_at_once = int(spec.get("jobs_at_once") or 0)  # models alive at once in run_jobs (0: all)
    measured: dict[str, dict[str, Any]] = {}

    def note(key: str, step_s: float, steps: int, per_rank: list[dict[str, Any]]) -> None:
        m = measured.setdefault(key, {"rounds": [], "steps": [], "per_rank_peak": None})
        m["rounds"].append(step_s)
        m["steps"].append(steps)
        peaks = [(x.get("peak_bytes"), x.get("peak_breakdown")) for x in per_rank]
        if m["per_rank_peak"] is None or max(p or 0 for p, _ in peaks) > max(p or 0 for p, _ in m["per_rank_peak"]):
            m["per_rank_peak"] = peaks  # the repeat with the highest peak, all its ranks

    def measure(keys: list[str], r: int) -> None:
        """Collective: repeat ``r`` of ``keys`` with osdp.harness.run_jobs (every model alive, one step of each in
        turn, so all see the same load), fairscale (CUDA only) after it."""
        ours = [k for k in keys if runs[k] != "fairscale"]
        groups = [ours[i:i + jobs_at_once] for i in range(0, len(ours), jobs_at_once)] if jobs_at_once else [ours]
        for group in filter(None, groups):
            out = run_jobs({k: runs[k] for k in group}, device=device, optimizer=optimizer, time_budget_s=per_run_s,
                           min_steps=min_steps, rounds=1)
            for k in group:
                note(k, out[k]["measured_step_s"], out[k]["steps"], out[k]["per_rank"])
        for k in keys:
            if runs[k] == "fairscale":
                mine = run_fairscale(build, batch, unit_paths=description.paths, device=device, time_budget_s=per_run_s,
                                     measure_memory=True, min_steps=min_steps)
                ranks = all_gather_objects(mine)
                note(k, statistics.median(max(ts) for ts in zip(*(x["step_s"] for x in ranks))), len(mine["step_s"]),
                     ranks)
        say(f"repeat {r + 1}/{rounds} ({time.perf_counter() - started:.0f} s): " + ", ".join(
            f"{k} {tokens / measured[k]['rounds'][-1]:,.0f}" for k in keys) + " tokens/s per rank")

    # ---- budgets: from the least any plan needs (predicted) to torch-ddp's measured peak (one short untimed pass)
    budgets = [int(x) for x in spec.get("budgets") or []]
    lowest = min(min_peak(build_problem(d, device_info, b, optimizer=optimizer, calibration=calibration))[0]
                 for d in descriptions)
    ddp_needs = None
    if spec.get("auto_budgets"):
        if "torch-ddp" not in runs:
            raise ValueError("auto budgets go up to where torch-ddp fits: include torch-ddp in the strategies")
        say("measuring torch-ddp's peak memory: the budgets go up to it")
        out = run_jobs({"torch-ddp": runs["torch-ddp"]}, device=device, optimizer=optimizer, time_budget_s=0.1,
                       min_steps=1, rounds=1)
        ddp_needs = out["torch-ddp"]["measured_peak_bytes"]
        budgets = sorted(set(budgets) | set(auto_budgets(lowest, ddp_needs, int(spec["auto_budgets"]))))
    for budget in budgets:
        request: dict[str, Any] = {"strategy": "osdp", "budget_bytes": budget}
        if rank == 0:
            try:
                found = search(descriptions, device_info, [b], budget=budget, calibration=calibration,
                               optimizer=optimizer, model_signature=signature).plan
                outcome = ("plan", found.to_json())
            except BudgetTooSmall as e:
                outcome = ("too small", e.min_peak_bytes)
        else:
            outcome = None
        kind, payload = broadcast_object(outcome)
        if kind == "plan":
            plan = Plan.from_json(payload)
            key = f"osdp@{budget / 2**20:.2f}MiB"
            runs[key] = Job(build, plan, batch)  # its own run, even where another budget has the same plan
            request.update(key=key, plan=plan)
        else:
            request.update(key=None, status="budget too small", needs_bytes=payload)
        requests.append(request)
    keys = list(runs)
    say(f"{len(keys)} runs (compute-only included), {rounds} repeats of at least {min_steps} timed steps each")
    for r in range(rounds):
        shift = r % len(keys)  # rotate the order between repeats
        measure(keys[shift:] + keys[:shift], r)

    if rank != 0:
        return None
    compute_rounds = measured[COMPUTE_ONLY]["rounds"]
    records = []
    for req in requests:
        key = req.get("key")
        rec: dict[str, Any] = {
            "model": model_name, "world_size": world_size, "batch_size": b, "seq_len": seq_len,
            "tokens_per_step_per_rank": tokens, "link": link.get("name"), "strategy": req["strategy"],
            "budget_bytes": req.get("budget_bytes"), "status": req.get("status", "ran"), "run": key,
            "reduce_scatter": reduce_scatter,
        }
        if "needs_bytes" in req:
            rec["needs_bytes"] = req["needs_bytes"]
        plan = req.get("plan")
        if plan is not None:
            rec.update(plan=plan.to_dict(), plan_hash=plan.hash, plan_summary=plan.summary(),
                       replicated_fraction=param_fraction(described(plan), plan, "replicate"), **predicted(plan))
        if key is not None and key in measured:
            rec["measured"] = summarize_run(measured[key], compute_rounds, tokens)
        records.append(rec)
    flops = device_info.flops.get("float32")
    busbw = device_info.collectives.bus_bandwidth("all_gather")
    link.update(measured_busbw_bytes_per_s={c: device_info.collectives.bus_bandwidth(c)
                                            for c in ("all_gather", "reduce_scatter", "all_reduce")},
                measured_flop_per_byte=flops / busbw if flops and busbw else None)
    return {
        "records": records,
        "model": model_name,
        "config": dict(vars(config)),
        "link": link,
        "reduce_scatter": reduce_scatter,
        "lowest_budget_bytes": lowest,
        "ddp_needs_bytes": ddp_needs,
        "compute_only": {"step_s_rounds": compute_rounds, "step_s_median": statistics.median(compute_rounds),
                         "tokens_per_s": tokens / statistics.median(compute_rounds)},
        "device_info": device_info.to_dict(),
        "calibration": machine.to_dict(),
        "description": {"source": description.source,
                        "profile_seconds": sum(d.profile_seconds for d in descriptions),
                        "granularities": [d.granularity for d in descriptions],
                        "from_cache": all(getattr(d, "from_cache", False) for d in descriptions)},
        "rounds": rounds,
        "min_steps": min_steps,
        "time_per_run_s": per_run_s,
        "machine": machine_info(device),
        "seconds": time.perf_counter() - started,
    }


def summarize_run(m: dict[str, Any], compute_rounds: list[float], tokens: int) -> dict[str, Any]:
    """A run's record: per repeat the median over its steps of the slowest rank's step; the median over repeats;
    efficiency = compute-only step / this step, paired by repeat; the highest peak over ranks and repeats."""
    per_round = list(m["rounds"])
    med = statistics.median(per_round)
    efficiency = [c / t for c, t in zip(compute_rounds, per_round)]
    return {
        "step_s_median": med,
        "step_s_rounds": per_round,
        "step_s_min": min(per_round),
        "step_s_max": max(per_round),
        "tokens_per_s": tokens / med,
        "tokens_per_s_rounds": [tokens / t for t in per_round],
        "efficiency": statistics.median(efficiency),
        "efficiency_rounds": efficiency,
        "peak_bytes": max((p or 0) for p, _ in m["per_rank_peak"]),
        "timed_steps": m["steps"],
        # ranks step together (every step ends in collectives): one step time, each rank's peak
        "per_rank": [{"rank": k, "peak_bytes": p, "peak_breakdown": bd} for k, (p, bd) in enumerate(m["per_rank_peak"])],
    }


def machine_info(device=None) -> dict[str, Any]:
    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "device": str(device) if device is not None else None,
        "threads_per_rank": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_at_end": os.getloadavg(),
    }


def worker_main(spec_path: Path, out_path: Path) -> int:
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    try:
        result = work(spec)
        if result is not None:
            out_path.write_text(json.dumps(result, indent=1, default=str))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the launcher


def launch(spec: dict[str, Any], *, nproc: int = 2, on_line: Callable[[str], None] = print,
           timeout_s: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` on ``nproc`` local ranks over ``spec['link']`` (loopback: torchrun --standalone; veth: one
    torchrun per namespace, static rendezvous on the veth address); the result of rank 0."""
    link = spec.get("link") or {"kind": "loopback"}
    env = dict(env or os.environ)
    env["OSDP_REDUCE_SCATTER"] = spec.get("reduce_scatter", DEFAULT_REDUCE_SCATTER)  # osdp.comm, on every rank
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="osdp-run-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        worker = [str(Path(__file__).resolve()), "--worker", str(spec_path), "--out", str(out_path)]
        if link["kind"] == "loopback":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
            code = _run_local(cmd, env, on_line, timeout_s)
            codes = [code]
        elif link["kind"] == "veth":
            if nproc != 2:
                raise ValueError("the veth link joins exactly 2 ranks")
            with netns.VethLink(rate_bit=link.get("rate_bit_per_s")) as veth:
                cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}",
                         "--nproc-per-node=1", f"--master-addr={veth.addresses[0]}", f"--master-port={DEFAULT_PORT}",
                         *worker] for i in range(2)]
                codes = netns.run_in_namespaces(veth, cmds, env, lambda r, line: on_line(line), timeout_s)
                link_desc = veth.describe()
            spec.setdefault("link_setup", link_desc)
        else:
            raise ValueError(f"unknown link kind {link['kind']!r}")
        if any(codes) or not out_path.exists():
            raise RuntimeError(f"the run failed (exit codes {codes}); see the output above")
        result = json.loads(out_path.read_text())
    if "link_setup" in spec and "link" in result:
        result["link"]["setup"] = spec["link_setup"]
    return result


def probe_link(link: dict[str, Any], *, reduce_scatter: str = DEFAULT_REDUCE_SCATTER,
               env: dict[str, str] | None = None, on_line: Callable[[str], None] = print) -> dict[str, Any]:
    """The collectives and FLOP/s measured on 2 ranks over ``link`` (``osdp.device.measure_device``), nothing
    trained: the ``device_info`` dict."""
    spec = {"model": "gpt2-tiny", "batch_size": 1, "link": link, "link_probe": True, "collective_time_s": 2.0,
            "reduce_scatter": reduce_scatter}
    return launch(spec, env=env, on_line=on_line)["device_info"]


def calibrate_gpu_ratio(link: dict[str, Any], *, env: dict[str, str] | None = None,
                        on_line: Callable[[str], None] = print, tolerance: float = 0.10, max_probes: int = 5,
                        reduce_scatter: str = DEFAULT_REDUCE_SCATTER) -> dict[str, Any]:
    """Adjust a ``gpu-ratio`` link's tbf rate until the core's FLOP/s over gloo's measured all-gather bus
    bandwidth on it is the target FLOP per byte within ``tolerance``.

    Probe, scale the rate by wanted / measured bandwidth, probe again: TCP,
    tbf and gloo each take a share of the nominal rate, and not in proportion
    to it. Stops at the first probe within tolerance; otherwise keeps the
    closest of ``max_probes``. Every probe is in ``calibration``.
    """
    from osdp.device import CollectiveModel

    target = link["target_flop_per_byte"]
    want = link["core_flops"] / target  # bytes/s of all-gather busbw
    rate, probes = link["rate_bit_per_s"], []
    for _ in range(max_probes):
        info = probe_link({**link, "rate_bit_per_s": rate}, reduce_scatter=reduce_scatter, env=env, on_line=on_line)
        busbw = CollectiveModel.from_dict(info["collectives"]).bus_bandwidth("all_gather")
        probes.append({"rate_bit_per_s": rate, "all_gather_busbw_bytes_per_s": busbw,
                       "flop_per_byte": link["core_flops"] / busbw, "device_info": info})
        on_line(f"calibration: tbf {rate / 1e6:.0f} Mbit/s -> all-gather busbw {busbw / 1e6:.1f} MB/s, "
                f"{link['core_flops'] / busbw:.0f} FLOP/byte (target {target:.0f})")
        if abs(link["core_flops"] / busbw / target - 1) <= tolerance:
            break
        rate = int(rate * want / busbw)
    best = min(probes, key=lambda p: abs(p["flop_per_byte"] / target - 1))
    rate = best["rate_bit_per_s"]
    return {**link, "rate_bit_per_s": rate, "nominal_rate_bit_per_s": link["rate_bit_per_s"],
            "probe_busbw_bytes_per_s": best["all_gather_busbw_bytes_per_s"],
            "probe_flop_per_byte": best["flop_per_byte"],
            "calibrated": abs(best["flop_per_byte"] / target - 1) <= tolerance,
            "calibration": [{k: v for k, v in p.items() if k != "device_info"} for p in probes],
            "probe_device_info": best["device_info"],
            "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s ({target:.0f} FLOP/byte, "
                     f"as {link.get('ratio_of', GPU_RATIO_PRESET)})"}


def collective_table(device_info: dict[str, Any]) -> str:
    """The fitted alpha and beta of each collective, its bus bandwidth, and beta against the all-gather's."""
    from osdp.device import COLLECTIVES, CollectiveModel

    model = CollectiveModel.from_dict(device_info["collectives"])
    ag = model.costs["all_gather"].beta_s_per_byte
    lines = [f"{'collective':<15} {'alpha (us)':>10} {'beta (ns/B)':>12} {'busbw (MB/s)':>13} {'beta / AG':>10}"]
    for c in COLLECTIVES:
        ab = model.costs[c]
        lines.append(f"{c:<15} {ab.alpha_s * 1e6:>10.1f} {ab.beta_s_per_byte * 1e9:>12.3f} "
                     f"{model.bus_bandwidth(c) / 1e6:>13.1f} {ab.beta_s_per_byte / ag if ag else float('nan'):>10.2f}")
    return "\n".join(lines) + f"\n({model.source})"


def _run_local(cmd: list[str], env: dict[str, str], on_line: Callable[[str], None], timeout_s: float | None) -> int:
    import threading

    p = netns.spawn(cmd, env)  # stopped on SIGINT/SIGTERM/SIGHUP and at exit, like the namespaced ranks

    def pump():
        for line in p.stdout:
            on_line(line.rstrip("\n"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        code = netns.stop(p)  # terminates the torchrun session we started if it is still running
        t.join(timeout=5)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt2-mini")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--strategy", choices=STRATEGIES)
    how.add_argument("--budget", help="OSDP at this per-rank budget (e.g. 60MiB)")
    how.add_argument("--probe-link", metavar="LINK",
                     help="only measure the collectives over LINK (gpu-ratio: after calibrating its rate)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--link", default="loopback", help="loopback, gpu-ratio, or tbf:RATE (e.g. tbf:600mbit)")
    ap.add_argument("--rounds", type=int, default=3, help="repeats (medians are reported)")
    ap.add_argument("--time-per-run", type=float, default=2.0, help="seconds of timed steps per repeat")
    ap.add_argument("--min-steps", type=int, default=MIN_STEPS, help="timed steps per repeat, at least")
    ap.add_argument("--reduce-scatter", choices=["native", "pairwise"], default=DEFAULT_REDUCE_SCATTER,
                    help="osdp.comm's reduce-scatter for every strategy (pairwise: NCCL's traffic on gloo)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", type=Path, help="write the record here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out)
    if args.probe_link:
        link = resolve_link(args.probe_link)
        if link["name"] == "gpu-ratio":
            link = calibrate_gpu_ratio(link, reduce_scatter=args.reduce_scatter)
            info = link.pop("probe_device_info")
            print(f"{link['label']}: {link['probe_flop_per_byte']:.0f} FLOP/byte measured "
                  f"({'within' if link['calibrated'] else 'NOT within'} 10% of the target)")
        else:
            info = probe_link(link, reduce_scatter=args.reduce_scatter)
        print(f"{link.get('label', link['name'])}, {args.reduce_scatter} reduce-scatter:\n{collective_table(info)}")
        if args.json:
            args.json.write_text(json.dumps({"link": link, "device_info": info, "reduce_scatter": args.reduce_scatter},
                                            indent=1, default=str))
        return 0
    from osdp.sizes import parse_size

    spec = {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
        "strategies": [args.strategy or "fsdp2"] if not args.budget else [],
        "budgets": [parse_size(args.budget)] if args.budget else [],
        "rounds": args.rounds, "time_per_run_s": args.time_per_run, "min_steps": args.min_steps,
        "reduce_scatter": args.reduce_scatter, "link": resolve_link(args.link),
    }
    # what osdp.wrap would do on this machine: its cached calibration, measured first if there is none
    launch({**spec, "calibrate": "if missing"}, nproc=args.nproc)
    result = launch(spec, nproc=args.nproc)
    record = {**result["records"][0], "link_info": result["link"], "machine": result["machine"],
              "device_info": result["device_info"], "compute_only": result["compute_only"]}
    text = json.dumps(record, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    m = record.get("measured")
    if m:
        predicted = (f"; predicted {record['predicted_tokens_per_s']:,.0f} tokens/s, "
                     f"{record['predicted_peak_bytes'] / 2**20:.1f} MiB" if record.get("predicted_tokens_per_s") else "")
        print(f"{record['strategy']}: {m['tokens_per_s']:,.0f} tokens/s per rank (median of {len(m['step_s_rounds'])} "
              f"repeats), efficiency {m['efficiency']:.2f}, peak {m['peak_bytes'] / 2**20:.1f} MiB{predicted}")
    else:
        print(f"{record['strategy']}: {record['status']}"
              + (f" (needs {record['needs_bytes'] / 2**20:.1f} MiB)" if record.get("needs_bytes") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
