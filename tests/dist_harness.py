"""Run a function on N local gloo ranks with bounded time; a hung test is a failed test."""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from osdp.distributed import free_port, init_process_group

COLLECTIVE_TIMEOUT_S = 60.0


def _pin(rank: int) -> None:
    """Each rank on a core of its own (round robin over the allowed cores).

    Unpinned, where the scheduler happens to put two ranks and gloo's threads
    on two cores shifts a whole run's step times together by up to +-20% from
    one process to the next; pinned, repeated runs agree within a few percent,
    which is what tests comparing measured with predicted step times need.
    """
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _pin(rank)
    try:
        init_process_group(rank, world_size, master_port=port, timeout_s=COLLECTIVE_TIMEOUT_S)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (module level). Any rank's exception fails the
    call with that rank's traceback; exceeding ``timeout`` kills every rank.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish within {timeout:.0f}s (ranks done: {sorted(results)})")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead:
                    errors.update({r: f"rank {r} died with exit code {procs[r].exitcode}" for r in dead})
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        # A rank whose peer crashed reports only "connection closed": show every rank's error.
        details = "\n".join(f"--- rank {r}:\n{errors[r]}" for r in sorted(errors))
        raise AssertionError(f"rank(s) {sorted(errors)} failed\n{details}")
    return [results[r] for r in range(world_size)]
