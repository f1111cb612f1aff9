"""Train a reference model under a plan or strategy: ``osdp train`` / ``python -m osdp.cli.train``.

Under torchrun every process is one rank. Run directly, it launches its own
local ranks (``--nproc``, default 2) through torchrun, so a first run needs
no launcher knowledge. Rank 0 prints the applied plan, the loss, step time and
tokens/s; at the end every rank's throughput and peak memory (CUDA:
``max_memory_allocated``; CPU: live tensor bytes) is gathered into one table.

Checkpoints and recovery: with ``--checkpoint-dir DIR`` the run saves the
model, the optimizer and the step (``osdp.runtime.dcp``) after the last step and,
with ``--checkpoint-every K``, every K steps; on start it resumes from the
newest complete checkpoint in DIR, under whatever plan and world size this run
has. Batches are a function of the step, so a resumed run sees the batches the
uninterrupted one would have. Under ``torchrun --max-restarts N`` (with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see ``osdp.distributed.warn_shared_store``) or
``osdp train --max-restarts N``, a rank that dies takes the job back to its
last checkpoint instead of ending it.

Testing aid (not for production use): ``OSDP_TEST_KILL_AT_STEP=S`` makes rank
``OSDP_TEST_KILL_RANK`` (default 1) kill itself with SIGKILL at the start of
step S, once: it first creates the file ``OSDP_TEST_KILL_MARKER`` (default
``DIR/.osdp_test_killed``), and does nothing while that file exists, so the
restarted job runs through.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import osdp
from osdp import models
from osdp.cli.launch import run_on_ranks
from osdp.describe.units import build_units
from osdp.distributed import all_gather_objects, peer_failures, warn_shared_store
from osdp.fsdp_ext.apply import complete_plan
from osdp.log import QUIET_ENV, format_seconds
from osdp.machine.identity import machine_info
from osdp.machine.memory import PeakMemory
from osdp.models.data import CorpusLoader, synthetic_batch
from osdp.optim import make_optimizer
from osdp.report import format_bytes, format_table, plan_table
from osdp.runtime import dcp as checkpoint
from osdp.runtime.step import train_step
from osdp.schema.plan import Plan

# gpt2-tiny at batch 8 x 64 on 2 ranks needs 3.66 MiB per rank at the least (everything sharded or checkpointed)
# and 4.74 MiB for every unit replicated (the fastest): a budget between gives a plan that mixes modes, which is
# what the default run is there to show (measured on a 2-core Xeon VM; the bounds move a little by machine)
DEFAULT_BUDGET = "4MiB"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-tiny", help=f"reference model ({', '.join(models.names())})")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--device-mem", default=None,
                     help=f"memory budget per rank (e.g. 16GiB): search the fastest plan that fits "
                          f"(the default, at {DEFAULT_BUDGET} for the default model)")
    how.add_argument("--strategy", choices=["ddp", "zero2", "fsdp"], help="a baseline: every unit in one mode")
    how.add_argument("--plan", type=Path, help="a Plan JSON file (osdp plan --json writes one)")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", choices=["corpus", "synthetic"], default="corpus",
                   help="the shipped text corpus (byte tokens) or random tokens")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines (describe, calibrate) and no per-step lines: the plan and the results only")
    p.add_argument("--json", type=Path, help="write the run's record (plan, losses, per-rank metrics) here")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch when not under torchrun (default 2)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when launching local ranks: restart them (from the last checkpoint) up to N times after a failure")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="save checkpoints here (after the last step, and every --checkpoint-every steps); "
                        "on start, resume from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K", help="also save every K steps")
    p.add_argument("--checkpoint-keep", type=int, default=2, metavar="N",
                   help="complete checkpoints to keep in --checkpoint-dir (default 2)")
    p.add_argument("--save-final", type=Path,
                   help="write the trained model as one plain torch.save state dict (unsharded, from rank 0) "
                        "that load_state_dict of the unwrapped model accepts")


def batch_source(config, args, rank: int, world_size: int, seq_len: int,
                 device: torch.device) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batch as a function of the step (deterministic in seed and step, so a resumed run
    sees the batches an uninterrupted one would)."""
    if args.data == "corpus" and not config.name.startswith("bert"):
        loader = CorpusLoader(seq_len, args.batch_size, rank, world_size, seed=args.seed)

        def at(step: int):
            inputs, targets = loader.batch(step)
            return inputs.to(device), targets.to(device)
    else:
        def at(step: int):
            g = torch.Generator().manual_seed(args.seed * 100003 + step * world_size + rank)
            inputs, targets = synthetic_batch(config, args.batch_size, seq_len, generator=g)
            return inputs.to(device), targets.to(device)
    return at


TEST_KILL_ENV = "OSDP_TEST_KILL_AT_STEP"


def _test_kill_hook(step: int, rank: int, checkpoint_dir: Path | None) -> None:
    """Testing aid (see the module docstring): SIGKILL this rank once at the start of a chosen step."""
    at = os.environ.get(TEST_KILL_ENV)
    if at is None or int(at) != step or rank != int(os.environ.get("OSDP_TEST_KILL_RANK", "1")):
        return
    marker = Path(os.environ.get("OSDP_TEST_KILL_MARKER") or (checkpoint_dir or Path(".")) / ".osdp_test_killed")
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} killed itself at step {step} (pid {os.getpid()})\n")
    print(f"[{TEST_KILL_ENV}] rank {rank}: SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def resume(args: argparse.Namespace, model, optimizer, plan: Plan, world_size: int, rank: int,
           run_info: dict[str, Any]) -> tuple[int, str | None]:
    """Load the newest complete checkpoint in ``--checkpoint-dir``; return (first step to run, its path)."""
    if args.checkpoint_dir is None:
        return 0, None
    found = checkpoint.agree_on_latest(args.checkpoint_dir)
    if found is None:
        return 0, None
    saved = checkpoint.info(found)
    extra = checkpoint.load(found, model, optimizer)
    start = int(extra.get("step", saved.get("step") or 0))
    if rank == 0:
        same = saved.get("plan_hash") == plan.hash and saved.get("world_size") == world_size
        now = "" if same else f"; now plan {plan.hash} on {world_size} ranks"
        print(f"resumed from {found} at step {start} (saved under plan {saved.get('plan_hash')} on "
              f"{saved.get('world_size')} ranks{now})", flush=True)
        changed = [k for k, v in run_info.items() if k in extra and extra[k] != v]
        if changed:
            print("warning: the checkpoint was written with different " + ", ".join(
                f"{k} ({extra[k]!r}, now {run_info[k]!r})" for k in changed) + "; the data stream differs", flush=True)
    return start, str(found)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Collective: train ``args.model`` on this job's ranks (the group is joined); the run's record."""
    models.quiet_view_warning()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    warn_shared_store(rank)
    config = models.get_config(args.model)
    seq_len = args.seq_len or config.seq_len
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = models.build(args.model).to(device)
    batch_at = batch_source(config, args, rank, world_size, seq_len, device)
    plan = wrapped(model, args, batch_at, device)
    optimizer = make_optimizer("adamw", model.parameters(), lr=args.lr)  # what the planner priced
    # What fixes the data stream: a resumed run that differs here sees other batches than the saved run would.
    run_info = {"model": args.model, "data": args.data, "seed": args.seed, "seq_len": seq_len}
    if args.data == "corpus" and not config.name.startswith("bert"):
        run_info["global_batch"] = args.batch_size * world_size  # the corpus loader's batches depend on this alone
    else:
        run_info.update(batch_size=args.batch_size, world_size=world_size)
    first_step, resumed_from = resume(args, model, optimizer, plan, world_size, rank, run_info)
    mine = train_steps(args, model, optimizer, batch_at, first_step, run_info, device)
    if args.save_final is not None:
        checkpoint.export_full(args.save_final, model)
        if rank == 0:
            print(f"full state dict written to {args.save_final}", flush=True)
    mine.update(rank=rank, tokens_per_s=args.batch_size * seq_len / mine["median_step_s"])
    per_rank = all_gather_objects(mine)
    record = {
        "model": args.model, "world_size": world_size, "batch_size": args.batch_size, "seq_len": seq_len,
        "steps": args.steps, "first_step": first_step, "resumed_from": resumed_from, "plan": plan.to_dict(),
        "predicted_step_s": plan.predicted_step_s,
        "measured_step_s": max(r["median_step_s"] for r in per_rank),  # the job runs at its slowest rank's pace
        "per_rank": per_rank, "machine": machine_info(device),
    }
    if rank == 0:
        report(args, plan, record)
    return record


def wrapped(model: torch.nn.Module, args: argparse.Namespace, batch_at: Callable, device: torch.device) -> Plan:
    """``model`` wrapped by the plan of ``--plan``, ``--strategy``, or searched at ``--device-mem``; the plan."""
    if args.plan is not None:
        plan = Plan.from_json(args.plan.read_text())
    elif args.strategy is not None:
        plan = osdp.strategy_plan(model, args.strategy)
    else:
        plan = osdp.plan(model, device_mem=args.device_mem or DEFAULT_BUDGET, example_input=batch_at(0),
                         mixed_precision=args.mixed_precision or "fp32")
    if args.mixed_precision:
        plan.mixed_precision = args.mixed_precision
    plan = complete_plan(model, plan)
    units = build_units(model, plan.paths)
    osdp.wrap(model, plan=plan, device=device)
    if dist.get_rank() == 0:
        print(plan_table(plan, units), flush=True)
    return plan


def train_steps(args: argparse.Namespace, model, optimizer, batch_at: Callable, first_step: int,
                run_info: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Steps ``first_step`` .. ``args.steps - 1``, checkpointed as asked; this rank's losses, step times (after
    the warm-up, the step whose memory is tracked left out: the CPU tracker slows it) and peak memory."""
    rank = dist.get_rank()
    memory_step = min(first_step + args.warmup, args.steps - 1)
    losses, step_times, peak, breakdown = [], [], None, None
    started = time.perf_counter()
    for step in range(first_step, args.steps):
        _test_kill_hook(step, rank, args.checkpoint_dir)
        meter = PeakMemory(device, model, optimizer) if step == memory_step else contextlib.nullcontext()
        with meter, peer_failures(f"training step {step}"):
            times = train_step(model, batch_at(step), optimizer, device=device)
            loss_value = times.loss.item()
        if step == memory_step:
            peak, breakdown = meter.stats().peak_bytes, dict(meter.stats().peak_breakdown)
        losses.append(loss_value)
        if step >= args.warmup and step != memory_step:
            step_times.append(times.seconds)
        if rank == 0 and not args.quiet and (step % args.log_every == 0 or step == args.steps - 1):
            elapsed, left = time.perf_counter() - started, args.steps - 1 - step
            pace = f"{format_seconds(elapsed)}, about {format_seconds(elapsed / (step + 1 - first_step) * left)} left"
            print(f"step {step:4d}/{args.steps}  loss {loss_value:.4f}  {times.seconds * 1e3:8.1f} ms  "
                  f"({pace if left else format_seconds(elapsed)})", flush=True)
        done = step + 1
        if args.checkpoint_dir is not None and (
            done == args.steps or (args.checkpoint_every and done % args.checkpoint_every == 0)
        ):
            path = checkpoint.save_step(args.checkpoint_dir, done, model, optimizer, {**run_info, "step": done},
                                        keep=args.checkpoint_keep)
            if rank == 0:
                print(f"checkpoint {path} (step {done})", flush=True)
    nan = float("nan")
    return {
        "median_step_s": statistics.median(step_times) if step_times else nan,
        "step_s_min": min(step_times, default=nan),
        "step_s_max": max(step_times, default=nan),
        # the middle half of the steps: the spread this run's noise gives a median
        "step_s_quartiles": statistics.quantiles(step_times, n=4)[::2] if len(step_times) >= 2 else None,
        "peak_bytes": peak,
        "peak_breakdown": breakdown,
        "losses": losses,
    }


def report(args: argparse.Namespace, plan: Plan, record: dict[str, Any]) -> None:
    """Rank 0's end of the run: every rank's step time, throughput and peak; prediction against measurement;
    the loss; the record as JSON (``--json``)."""
    per_rank, losses = record["per_rank"], record["per_rank"][0]["losses"]
    rows = [[r["rank"], f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
             "-" if r["peak_bytes"] is None else format_bytes(r["peak_bytes"])] for r in per_rank]
    print(format_table(rows, ["rank", "step ms (median)", "tokens/s", "peak memory"], "rrrr"))
    slowest = max(per_rank, key=lambda r: r["median_step_s"])
    if plan.predicted_step_s is not None and not math.isnan(slowest["median_step_s"]):
        print(step_time_line(plan.predicted_step_s, slowest, plan.meta.get("calibration", "not recorded")),
              flush=True)
    if losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {record['first_step']}..{args.steps - 1}",
              flush=True)
    else:
        print(f"nothing to train: the checkpoint is already at step {record['first_step']} of {args.steps}",
              flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))


def step_time_line(predicted_s: float, slowest: dict, calibration: str) -> str:
    """The measured median step (the slowest rank's) with the spread of its middle half, the prediction, and
    whether they differ by more than that spread: a difference within the run's own noise says nothing."""
    measured = slowest["median_step_s"]
    line = f"step time: measured {measured * 1e3:.1f} ms (median of the slowest rank"
    quartiles = slowest.get("step_s_quartiles")
    if quartiles is None:
        return line + f"), predicted {predicted_s * 1e3:.1f} ms ({predicted_s / measured - 1:+.1%})"
    low, high = quartiles
    line += (f"; its middle half {low * 1e3:.1f}-{high * 1e3:.1f} ms), predicted {predicted_s * 1e3:.1f} ms "
             f"({predicted_s / measured - 1:+.1%})")
    if low <= predicted_s <= high:
        return line + ": within this run's spread"
    return line + (f": outside this run's spread, so the calibration ({calibration}) priced this machine "
                   "otherwise than it ran now (noise from other processes, or a stale calibration: osdp calibrate "
                   "--force measures it again)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="osdp train", description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_keep < 1:
        parser.error("--checkpoint-keep must be >= 1")
    if args.quiet:
        os.environ[QUIET_ENV] = "1"  # the ranks inherit it
    return run_on_ranks("osdp.cli.train", argv, nproc=args.nproc, device=args.device,
                        body=lambda device: run(args, device), max_restarts=args.max_restarts)

if __name__ == "__main__":
    sys.exit(main())

