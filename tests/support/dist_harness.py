"""The tests' multi-rank runs: N local gloo ranks, one thread and one core each, with bounded time.

A hung test is a failed test: collectives time out after ``COLLECTIVE_TIMEOUT_S``
and the whole run after ``timeout``. Ranks are pinned to cores so that tests
comparing measured with predicted step times see repeatable times.
"""

from __future__ import annotations

from typing import Any, Callable

from osdp.distributed import local_ranks
from osdp.distributed.local_ranks import run_local_ranks

COLLECTIVE_TIMEOUT_S = 60.0

# The fork server every test's ranks are forked from imports these once (beside osdp's own, ``PRELOAD``): the
# Hugging Face and Lightning tests' ranks would each import them again, 2-4 s a rank per test. The ranks see the
# same modules either way; none of them starts a thread at import.
local_ranks.PRELOAD = [*local_ranks.PRELOAD, "transformers.modeling_utils", "transformers.trainer",
                       "lightning.pytorch"]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank (see ``run_local_ranks``)."""
    return run_local_ranks(fn, world_size, *args, timeout_s=timeout, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                           threads=1, pin=True)
