"""One experiment run: a reference model on N data-parallel ranks, one strategy or one OSDP budget -> one JSON record.

    python experiments/run.py --model gpt2-mini --strategy fsdp --json fsdp.json
    python experiments/run.py --model gpt2-mini --budget 60MiB --link gpu-ratio --json osdp.json

A record holds: tokens/s per rank, the step time (median over repeats, and its
spread), peak memory per rank with osdp.memory's breakdown, the plan, the
cost model's predicted step time and peak against the measured ones, the link
(loopback, or the shaped veth link of ``netns.py`` with its measured
bandwidth), the machine and the torch version.

Strategies: ``ddp``, ``zero2`` (zero2 everywhere), ``fsdp`` (zero3 everywhere),
``osdp`` at a budget (what ``osdp.wrap(model, device_mem=B, example_input=...)``
plans: the same description (``planner.planning_description``) and
``planner.search`` with this machine's cached calibration, which a run of its
own measures first if there is none), and ``fairscale`` (fairscale's FSDP,
ZeRO-3 with one FSDP instance per OSDP unit; CUDA only: its FSDP uses CUDA
streams unconditionally and fails on CPU).

The sweep (``sweep.py``) runs many of these in one process group per model
and link (``--spec``): every plan is trained once per round, rounds
interleaved, so that a shared machine's slow phases spread over all plans; a
plan chosen at several budgets, or equal to a baseline, runs once. The runner
is ``osdp.harness.run_jobs``: in each repeat every plan's model is built and
wrapped, and the plans take one step each in turn (warm-up, timed steps, one
extra step under ``osdp.memory.PeakMemory``); a repeat's step time is the
median over its steps of the slowest rank's.
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

STRATEGIES = ("ddp", "zero2", "fsdp")
EXTRA_STRATEGIES = ("fairscale",)
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
                  warmup: int = 2, min_steps: int = 3, max_steps: int = 40) -> dict[str, Any]:
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


def param_fraction(description, plan, mode: str) -> float:
    """Share of the parameter bytes that ``plan`` puts in ``mode``."""
    total = sum(u.param_bytes for u in description.units) or 1
    by_path = {u.path: u.mode for u in plan.units}
    return sum(u.param_bytes for u in description.units if by_path.get(u.path, "zero3") == mode) / total


def half_replicated_peak(problem, description) -> int:
    """An upper bound of the least predicted peak of a plan that replicates at least half of the parameter
    bytes: the least-memory plan (``min_peak``), then the largest units replicated (with checkpointing where
    allowed) until half the bytes are, greedily."""
    from osdp.search import min_peak

    _, choice = min_peak(problem)
    choice = choice.copy()
    index = {tuple(o): i for i, o in enumerate(problem.options)}
    sizes = {u.path: u.param_bytes for u in description.units}
    total, replicated = sum(sizes.values()) or 1, 0
    row = {path: i for i, path in enumerate(problem.units)}
    for path in sorted(sizes, key=lambda p: -sizes[p]):
        if replicated >= total / 2:
            break
        i = row[path]
        options = [index[o] for o in (("replicate", 1, True), ("replicate", 1, False)) if problem.allowed[i, index[o]]]
        choice[i] = min(options, key=lambda j: problem.mem[i, j] + problem.transient[i, j])
        replicated += sizes[path]
    return problem.peak(choice)


def auto_budgets(low: int, high: int, count: int) -> list[int]:
    """``count`` budgets from ``low`` to ``high`` inclusive, evenly spaced, rounded up to KiB."""
    if count <= 1 or high <= low:
        return [-(-high // 1024) * 1024]
    return sorted({-(-int(low + (high - low) * i / (count - 1)) // 1024) * 1024 for i in range(count)})


def work(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Collective (every rank, under torchrun): the runs of ``spec``; rank 0 returns the result."""
    import torch
    import torch.distributed as dist
    import warnings

    import osdp
    from osdp import models
    from osdp.calibration import calibrate
    from osdp.cost import build_problem, predict
    from osdp.data import synthetic_batch
    from osdp.device import measure_device
    from osdp.distributed import all_gather_objects, broadcast_object, init_from_env
    from osdp.harness import Job, run_jobs
    from osdp.log import Progress
    from osdp.machine import machine_info
    from osdp.plan import Plan
    from osdp.planner import planning_description, search
    from osdp.search import BudgetTooSmall, min_peak
    from osdp.units import structure_signature

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
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
        say("measuring collectives and FLOP/s on the live group")
        device_info = broadcast_object(measure_device(time_budget_s=float(spec.get("collective_time_s", 3.0))))
        return {"device_info": device_info.to_dict()} if rank == 0 else None
    if spec.get("calibrate"):  # this link's calibration, in its own run before the measured ones
        machine = calibrate(device, force=spec["calibrate"] == "force")
        return {"calibration": machine.to_dict(), "summary": machine.summary()} if rank == 0 else None
    # what osdp.wrap plans with: this job's calibration, measured by an earlier run (spec "calibrate")
    machine = calibrate(device, measure=False)
    device_info, calibration = machine.device_info, machine.calibration
    say(machine.summary())
    model = build().to(device)
    say("describing the model as osdp.plan does (rank 0; cached in OSDP_CACHE_DIR)")
    description = planning_description(model, batch)
    signature = structure_signature(model)
    del model

    settings = dict(batch_size=b, world_size=world_size, model_signature=signature)
    optimizer = "adamw"

    def predicted(plan: Plan) -> dict[str, Any]:
        p = predict(description, plan, device_info, optimizer=optimizer, calibration=calibration)
        return {"predicted_step_s": p.step_s, "predicted_peak_bytes": p.peak_bytes,
                "predicted_tokens_per_s": tokens / p.step_s}

    # ---- what to run: key -> plan (or "fairscale"); requests -> key
    plans: dict[str, Any] = {}
    requests: list[dict[str, Any]] = []
    for s in spec.get("strategies", []):
        if s in EXTRA_STRATEGIES:
            if device.type != "cuda":
                requests.append({"strategy": s, "key": None,
                                 "status": "skipped: fairscale FSDP needs CUDA (it uses CUDA streams unconditionally)"})
                continue
            plans[s] = "fairscale"
            requests.append({"strategy": s, "key": s})
            continue
        plan = osdp.strategy_plan(build(), s, **settings)
        plans.setdefault(plan.hash, plan)
        requests.append({"strategy": s, "key": plan.hash, "plan": plan})

    rounds = int(spec.get("rounds", 3))
    per_run_s = float(spec.get("time_per_run_s", 1.5))
    measured: dict[str, dict[str, Any]] = {}

    jobs_at_once = int(spec.get("jobs_at_once") or 0)  # models alive at once in run_jobs (0: all)

    def measure(keys: list[str], r: int, *, time_s: float, min_steps: int = 3, timed: bool = True) -> None:
        """Collective: one repeat of ``keys`` with osdp.harness.run_jobs (every model alive, one step of each
        in turn, so all see the same load), fairscale (CUDA only) after it."""
        osdp_keys = [k for k in keys if plans[k] != "fairscale"]
        groups = [osdp_keys[i:i + jobs_at_once] for i in range(0, len(osdp_keys), jobs_at_once)] \
            if jobs_at_once else [osdp_keys]
        for group in filter(None, groups):
            out = run_jobs({k: Job(build, plans[k], batch) for k in group}, device=device, optimizer=optimizer,
                           time_budget_s=time_s, min_steps=min_steps, rounds=1)
            for k in group:
                m = measured.setdefault(k, {"rounds": [], "per_rank_peak": None})
                if m["per_rank_peak"] is None:
                    m["per_rank_peak"] = [(x.get("peak_bytes"), x.get("peak_breakdown")) for x in out[k]["per_rank"]]
                if timed:
                    m["rounds"].append(out[k]["measured_step_s"])
                    m["steps"] = m.get("steps", 0) + out[k]["steps"]
        for k in keys:
            if plans[k] == "fairscale":
                mine = run_fairscale(build, batch, unit_paths=description.paths, device=device, time_budget_s=time_s,
                                     measure_memory=r == 0)
                ranks = all_gather_objects(mine)
                m = measured.setdefault(k, {"rounds": [], "per_rank_peak": None})
                if r == 0:
                    m["per_rank_peak"] = [(x.get("peak_bytes"), x.get("peak_breakdown")) for x in ranks]
                m["rounds"].append(max(statistics.median(x["step_s"]) for x in ranks))
        if timed:
            say(f"repeat {r + 1}/{rounds} ({time.perf_counter() - started:.0f} s): " + ", ".join(
                f"{labels[k]} {tokens / measured[k]['rounds'][-1]:,.0f}" for k in keys) + " tokens/s per rank")

    # ---- the baselines' peaks first (one short untimed pass): DDP's measured peak bounds the budgets
    labels = {r["key"]: r["strategy"] for r in requests if r.get("key")}
    say("measuring the baselines' peak memory")
    measure([k for k in plans if plans[k] != "fairscale"], 0, time_s=0.1, min_steps=1, timed=False)

    budgets = [int(x) for x in spec.get("budgets") or []]
    problem = build_problem(description, device_info, b, optimizer=optimizer, calibration=calibration)
    lowest, _ = min_peak(problem)
    half_replicated = half_replicated_peak(problem, description)
    ddp = next((r for r in requests if r["strategy"] == "ddp" and r.get("key")), None)
    ddp_needs = None
    if ddp is not None:
        ddp_needs = max(predicted(ddp["plan"])["predicted_peak_bytes"],
                        max((p or 0) for p, _ in measured[ddp["key"]]["per_rank_peak"]))
    if spec.get("auto_budgets"):
        if ddp_needs is None:
            raise ValueError("auto budgets go up to where DDP fits: include ddp in the strategies")
        budgets = sorted(set(budgets) | set(auto_budgets(lowest, ddp_needs, int(spec["auto_budgets"]))))
    for budget in budgets:
        request: dict[str, Any] = {"strategy": "osdp", "budget_bytes": budget}
        if rank == 0:
            try:
                found = search(description, device_info, [b], budget=budget, calibration=calibration,
                               optimizer=optimizer, model_signature=signature).plan
                outcome = ("plan", found.to_json())
            except BudgetTooSmall as e:
                outcome = ("too small", e.min_peak_bytes)
        else:
            outcome = None
        kind, payload = broadcast_object(outcome)
        if kind == "plan":
            plan = Plan.from_json(payload)
            request.update(key=plan.hash, plan=plan)
            if plan.hash not in plans:
                plans[plan.hash] = plan
                labels[plan.hash] = f"osdp@{budget / 2**20:.1f}MiB"
        else:
            request.update(key=None, status="budget too small", needs_bytes=payload)
        requests.append(request)
    keys = list(plans)
    say(f"{len(keys)} distinct plans, {rounds} repeats")
    for r in range(rounds):
        shift = r % len(keys)  # rotate the order between repeats
        measure(keys[shift:] + keys[:shift], r, time_s=per_run_s)

    if rank != 0:
        return None
    records = []
    for req in requests:
        key = req.get("key")
        rec: dict[str, Any] = {
            "model": model_name, "world_size": world_size, "batch_size": b, "seq_len": seq_len,
            "tokens_per_step_per_rank": tokens, "link": link.get("name"), "strategy": req["strategy"],
            "budget_bytes": req.get("budget_bytes"), "status": req.get("status", "ran"),
        }
        if "needs_bytes" in req:
            rec["needs_bytes"] = req["needs_bytes"]
        plan = req.get("plan")
        if plan is not None:
            rec.update(plan=plan.to_dict(), plan_hash=plan.hash, plan_summary=plan.summary(),
                       replicated_fraction=param_fraction(description, plan, "replicate"), **predicted(plan))
        if key is not None and key in measured:
            m = measured[key]
            per_round = list(m["rounds"])  # per repeat: median over steps of the slowest rank's step
            med = statistics.median(per_round)
            rec["same_run_as"] = labels[key]
            rec["measured"] = {
                "step_s_median": med,
                "step_s_rounds": per_round,
                "step_s_min": min(per_round),
                "step_s_max": max(per_round),
                "tokens_per_s": tokens / med,
                "tokens_per_s_rounds": [tokens / t for t in per_round],
                "peak_bytes": max((p or 0) for p, _ in m["per_rank_peak"]),
                "timed_steps": m.get("steps"),
                # ranks step together (every step ends in collectives): one step time, this rank's peak
                "per_rank": [
                    {"rank": k, "step_s_median": med, "tokens_per_s": tokens / med, "peak_bytes": p,
                     "peak_breakdown": bd}
                    for k, (p, bd) in enumerate(m["per_rank_peak"])
                ],
            }
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
        "lowest_budget_bytes": lowest,
        "ddp_needs_bytes": ddp_needs,
        "half_replicated_peak_bytes": half_replicated,
        "device_info": device_info.to_dict(),
        "calibration": machine.to_dict(),
        "description": {"source": description.source, "profile_seconds": description.profile_seconds,
                        "from_cache": getattr(description, "from_cache", False)},
        "rounds": rounds,
        "time_per_run_s": per_run_s,
        "machine": machine_info(device),
        "seconds": time.perf_counter() - started,
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


def calibrate_gpu_ratio(link: dict[str, Any], *, env: dict[str, str] | None = None,
                        on_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Adjust a ``gpu-ratio`` link's tbf rate once so that gloo's measured all-gather bus bandwidth over it (not
    the nominal rate: TCP, tbf and gloo each take a share) gives the target FLOP/s per byte."""
    want = link["core_flops"] / link["target_flop_per_byte"]  # bytes/s of all-gather busbw
    probe = {"model": "gpt2-tiny", "batch_size": 1, "link": link, "link_probe": True, "collective_time_s": 2.0}
    from osdp.device import CollectiveModel

    got = launch(probe, env=env, on_line=on_line)["device_info"]
    busbw = CollectiveModel.from_dict(got["collectives"]).bus_bandwidth("all_gather")
    rate = int(link["rate_bit_per_s"] * want / busbw)
    return {**link, "rate_bit_per_s": rate, "nominal_rate_bit_per_s": link["rate_bit_per_s"],
            "probe_busbw_bytes_per_s": busbw,
            "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s ({link['target_flop_per_byte']:.0f} FLOP/byte, "
                     f"as {link.get('ratio_of', GPU_RATIO_PRESET)})"}


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
    how.add_argument("--strategy", choices=[*STRATEGIES, *EXTRA_STRATEGIES])
    how.add_argument("--budget", help="OSDP at this per-rank budget (e.g. 60MiB)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--link", default="loopback", help="loopback, gpu-ratio, or tbf:RATE (e.g. tbf:600mbit)")
    ap.add_argument("--rounds", type=int, default=3, help="repeats (medians are reported)")
    ap.add_argument("--time-per-run", type=float, default=2.0, help="seconds of timed steps per repeat")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", type=Path, help="write the record here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out)
    from osdp.sizes import parse_size

    spec = {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
        "strategies": [args.strategy or "fsdp"] if not args.budget else [],
        "budgets": [parse_size(args.budget)] if args.budget else [],
        "rounds": args.rounds, "time_per_run_s": args.time_per_run, "link": resolve_link(args.link),
    }
    # what osdp.wrap would do on this machine: its cached calibration, measured first if there is none
    launch({**spec, "calibrate": "if missing"}, nproc=args.nproc)
    result = launch(spec, nproc=args.nproc)
    record = {**result["records"][0], "link_info": result["link"], "machine": result["machine"],
              "device_info": result["device_info"]}
    text = json.dumps(record, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    m = record.get("measured")
    if m:
        print(f"{record['strategy']}: {m['tokens_per_s']:,.0f} tokens/s per rank (median of {len(m['step_s_rounds'])}), "
              f"peak {m['peak_bytes'] / 2**20:.1f} MiB; predicted {record['predicted_tokens_per_s']:,.0f} tokens/s, "
              f"{record['predicted_peak_bytes'] / 2**20:.1f} MiB")
    else:
        print(f"{record['strategy']}: {record['status']}"
              + (f" (needs {record['needs_bytes'] / 2**20:.1f} MiB)" if record.get("needs_bytes") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
