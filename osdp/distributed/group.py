"""Process-group setup and helpers: local launch, joining the group, timeouts, agreement checks.

``launch_local`` re-runs a command on N local ranks through torchrun (so
``osdp train`` needs no launcher knowledge); ``init_from_env`` is how every
rank of an osdp command joins the group. The agreement helpers run before any
model collective, so that a rank which cannot proceed says why on every rank
instead of leaving the others hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import subprocess
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    """The limit on any one collective: ``OSDP_COLLECTIVE_TIMEOUT_S`` as set now (default 300 s)."""
    return float(os.environ.get("OSDP_COLLECTIVE_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | str | None = None) -> str:
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return "nccl"
    if device is None and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def init_process_group(
    rank: int,
    world_size: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int,
    backend: str = "gloo",
    timeout_s: float | None = None,
) -> None:
    """Join a process group on an explicit TCP store with a collective timeout (None: ``collective_timeout_s()``)."""
    let_backend_threads_finish_at_exit()
    timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=(rank == 0),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE`` (torchrun would take ``--nproc`` for its own flag)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def launch_local(nproc: int, module: str, argv: list[str], max_restarts: int = 0) -> int:
    """Re-run this command on ``nproc`` local ranks through torchrun."""
    argv = without_option(without_option(argv, "--nproc"), "--max-restarts")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    restarts = [f"--max-restarts={max_restarts}", "--monitor-interval=0.5"] if max_restarts else []
    if max_restarts:
        env.setdefault(SHARED_STORE_ENV, "1")  # a fresh store for every attempt (see warn_shared_store)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *restarts, "-m", module, *argv]
    return subprocess.call(cmd, env=env)


SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def warn_shared_store(rank: int) -> None:
    """Say so when torchrun may restart this job on the store of the previous attempt.

    By default torchrun's workers build their process group on the agent's own
    store, which outlives a restart, so a restarted rank can read the dead
    attempt's addresses and fail with "Gloo connectFullMesh failed ... Connection
    refused" (PyTorch issue 135712; seen with torch 2.13 in 3 of 5 restarts here).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives every
    attempt a fresh store; ``osdp train --max-restarts`` sets it.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if rank == 0 and restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(f"warning: torchrun --max-restarts {restarts} shares its store with the workers, so a restarted "
              "job may fail to connect (Gloo connectFullMesh ... Connection refused, PyTorch issue 135712); "
              f"run torchrun with {SHARED_STORE_ENV}=1", flush=True)


def init_from_env(device_choice: str) -> torch.device:
    """Join the torchrun process group; pick the device and give each CPU rank one thread."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = torch.device("cpu")
    let_backend_threads_finish_at_exit()
    # Every collective is bounded: a dead or stuck peer gives an error here, not a hang.
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=collective_timeout_s()))
    return device


def job_device() -> torch.device:
    """The device a job on the default process group computes on: CUDA with NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# How long the interpreter waits at exit, with the GIL released, for the backend's worker threads (below).
EXIT_PAUSE_S = 0.1
_exit_pause_registered = False


def _pause_for_backend_threads() -> None:
    time.sleep(EXIT_PAUSE_S)


def let_backend_threads_finish_at_exit() -> None:
    """Give gloo's worker threads the GIL once more before the interpreter shuts down (once per process).

    A gloo worker thread drops a finished collective's tensors after the caller
    has moved on, and dropping a tensor that Python made takes the GIL. Where the
    group outlives ``destroy_process_group()`` (a model, a device mesh or osdp's
    reducer still holds it) and the process exits within a few milliseconds of
    its last collective, that thread asks for the GIL after shutdown has begun,
    and the process aborts: "terminate called without an active exception"
    (PyTorch issue 190489). An exit handler runs
    before that point; its pause lets the thread finish.
    """
    global _exit_pause_registered
    if not _exit_pause_registered:
        atexit.register(_pause_for_backend_threads)
        _exit_pause_registered = True


def ensure_process_group() -> None:
    """A single process without torchrun gets a one-rank gloo group, so ``osdp.wrap`` works in a notebook."""
    let_backend_threads_finish_at_exit()
    if dist.is_initialized():
        return
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1":
        raise RuntimeError(
            "osdp.wrap found RANK/WORLD_SIZE set but no process group: call "
            "torch.distributed.init_process_group() on every rank before osdp.wrap"
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


RANKS_PER_NODE_ENV = "LOCAL_WORLD_SIZE"  # set by torchrun on every rank: the ranks it started on this node


def ranks_per_node() -> int:
    """Ranks on each node: torchrun's ``LOCAL_WORLD_SIZE`` (every rank, one node, without it).

    torchrun numbers ranks node by node, so node i holds ranks
    i * ranks_per_node ... (i + 1) * ranks_per_node - 1: the rows of a
    (nodes, ranks_per_node) device mesh.
    """
    _, world_size = world()
    value = os.environ.get(RANKS_PER_NODE_ENV)
    if value is None:
        return world_size
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{RANKS_PER_NODE_ENV}={value!r} is not a number of ranks") from None
    if n < 1 or world_size % n:
        raise ValueError(f"{RANKS_PER_NODE_ENV}={n} does not divide the world size {world_size} into whole nodes")
    return n


def all_gather_objects(obj: Any) -> list[Any]:
    rank, world_size = world()
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    rank, world_size = world()
    if world_size == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def raise_on_any_rank(error: BaseException | None) -> None:
    """Collective: every rank raises if any rank failed, naming the ranks and the first error.

    Call it after a local check that may fail, so that a failure on one rank
    becomes the same clear error everywhere instead of a hang at the next
    collective. A rank that failed raises its own error unchanged; the others
    raise the first failed rank's error type (where it can be rebuilt from a
    message) as "rank(s) [...] failed: <message>".
    """
    rank, world_size = world()
    if world_size == 1:
        if error is not None:
            raise error
        return
    messages = all_gather_objects(
        None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    )
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    module, qualname, text = messages[failed[0]]
    message = f"rank(s) {failed} failed: {qualname}: {text}"
    exc_type: type = RuntimeError
    found: Any = sys.modules.get(module)  # the failed rank's error type, so that callers can catch it everywhere
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Exception):
        exc_type = found
    try:
        raised = exc_type(message)
    except Exception:  # noqa: BLE001 - exception types with unusual constructors
        raised = RuntimeError(message)
    raise raised


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised or did not arrive in time."""


# What gloo and NCCL say when the other side of a collective is gone or late.
_PEER_SIGNS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
    "communicator was aborted", "remote worker crashing",
)


def as_peer_failure(error: BaseException, what: str) -> PeerFailure | None:
    """A clear :class:`PeerFailure` for a backend error caused by another rank, else None."""
    if isinstance(error, PeerFailure) or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not any(sign in text.lower() for sign in _PEER_SIGNS):
        return None
    rank, world_size = world()
    timed_out = "time" in text.lower()
    how = "timed out" if timed_out else "lost its connection to another rank"
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return PeerFailure(
        f"rank {rank} of {world_size}: {what}: a collective {how}. Another rank has probably died or raised "
        "an error (its own output shows the cause), or did not reach this collective within the collective "
        f"timeout (OSDP_COLLECTIVE_TIMEOUT_S for the groups osdp creates). Backend: {first_line}"
    )


@contextlib.contextmanager
def peer_failures(what: str) -> Iterator[None]:
    """Turn a backend error caused by another rank (connection closed, timeout) into a PeerFailure."""
    try:
        yield
    except RuntimeError as e:
        failure = as_peer_failure(e, what)
        if failure is None:
            raise
        raise failure from e
