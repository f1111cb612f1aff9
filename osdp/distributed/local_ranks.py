"""Run a function on N local gloo ranks of spawned processes, with bounded time (tests and experiments).

Under torchrun a job's ranks are separate launches; this is the in-process
equivalent for a function: one spawned process per rank, a TCP store on rank
0, every rank's result or traceback returned to the caller, and a deadline
after which every rank is killed, so a hung collective fails instead of
hanging.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from osdp.distributed import free_port, init_process_group


def _pin(rank: int) -> None:
    """Each rank on a core of its own (round robin over the allowed cores).

    Unpinned, where the scheduler happens to put two ranks and gloo's threads
    on two cores shifts a whole run's step times together by up to +-20% from
    one process to the next; pinned, repeated runs agree within a few percent.
    """
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


# Imported once by the fork server that every rank is forked from, instead of by each spawned rank (about
# 2.5 seconds a rank, most of a short multi-rank test). osdp reads its settings (OSDP_*) when called, not
# when imported, so the ranks see their caller's.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.nn.parallel", "osdp.api", "osdp.planner",
           "osdp.calibration.measured", "osdp.runtime.dcp"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(rank: int, world_size: int, port: int, options: dict[str, Any], fn: Callable, args: tuple,
               results, release) -> None:
    # a rank forks from the fork server, started with the environment and directory of its first caller:
    # take this caller's
    os.environ.clear()
    os.environ.update(options["environ"])
    os.chdir(options["cwd"])
    os.environ["OMP_NUM_THREADS"] = str(options["threads"])
    torch.set_num_threads(options["threads"])
    if options["pin"]:
        _pin(rank)
    try:
        init_process_group(rank, world_size, master_port=port, timeout_s=options["collective_timeout_s"])
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        # Rank 0 hosts the TCP store: had it exited as soon as its own function returned, a peer still in
        # gloo's rendezvous would read "connection closed" instead of its own result or error. A rank that
        # finished waits until the caller has heard from all; one that failed goes at once, as a crashed
        # process would, so that its peers see their connections close.
        release.wait(timeout=options["collective_timeout_s"])
    except BaseException as e:  # noqa: BLE001 - every failure goes to the caller, with its rank
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0,
                    collective_timeout_s: float = 60.0, threads: int = 1, pin: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks; their return values, by rank.

    ``fn`` must be importable (module level) and its results picklable. Any
    rank's exception raises ``AssertionError`` with every failed rank's
    traceback (a rank whose peer crashed reports only "connection closed", so
    all are shown); past ``timeout_s`` every rank is killed and ``TimeoutError``
    raised. ``threads`` per rank; ``pin`` puts each rank on a core of its own.
    """
    ctx = _context()
    results, release = ctx.Queue(), ctx.Event()
    options = {"threads": threads, "pin": pin, "collective_timeout_s": collective_timeout_s,
               "environ": dict(os.environ), "cwd": os.getcwd()}
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, options, fn, args, results, release))
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f}s (ranks done: {sorted(done)})")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in done and r not in errors:
                        errors[r] = f"rank {r} died with exit code {p.exitcode}"
                continue
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        release.set()
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        details = "\n".join(f"--- rank {r}:\n{errors[r]}" for r in sorted(errors))
        raise AssertionError(f"rank(s) {sorted(errors)} failed\n{details}")
    return [done[r] for r in range(world_size)]
