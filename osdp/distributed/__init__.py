"""Ranks: joining the process group, agreeing across ranks, local launches, and the collectives units make.

``osdp.distributed.group`` (re-exported here) starts and joins the process group and holds the agreement
helpers every collective code path uses (``raise_on_any_rank``, ``PeerFailure``); ``local_ranks`` runs a
function on N spawned local ranks (tests, experiments); ``collectives`` holds the reduce-scatter and
all-gather that FSDP2 units and split Linears issue on gloo.
"""

from osdp.distributed.group import (
    PeerFailure,
    all_gather_objects,
    as_peer_failure,
    broadcast_object,
    collective_timeout_s,
    default_backend,
    ensure_process_group,
    free_port,
    init_from_env,
    init_process_group,
    job_device,
    launch_local,
    let_backend_threads_finish_at_exit,
    peer_failures,
    raise_on_any_rank,
    ranks_per_node,
    warn_shared_store,
    without_option,
    world,
)

__all__ = [
    "PeerFailure", "all_gather_objects", "as_peer_failure", "broadcast_object", "collective_timeout_s",
    "default_backend", "ensure_process_group", "free_port", "init_from_env", "init_process_group", "job_device", "launch_local",
    "let_backend_threads_finish_at_exit", "peer_failures",
    "raise_on_any_rank", "ranks_per_node", "warn_shared_store", "without_option", "world",
]
