import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _use_the_store_after_rank_zero_returned(rank, world_size):
    if rank == 0:
        return "returned at once"
    time.sleep(2.0)  # rank 0's function has long returned: its process must still host the store
    store = dist.distributed_c10d._get_default_store()
    store.set("late", "ok")
    return store.get("late").decode()


def test_all_reduce_matches_sum_of_ranks():
    assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]


def test_rank_error_is_reported_with_its_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[1\] failed.*--- rank 1:.*boom on rank 1"):
        run_ranks(_raise_on_rank_one, 2)


def test_rank_zero_hosts_the_store_until_every_rank_has_finished():
    # rank 0 hosts the TCP store; were it to exit when its own function returned, a peer still using the
    # store (as gloo's rendezvous does) would fail with "connection closed" (seen once in a full suite run)
    assert run_ranks(_use_the_store_after_rank_zero_returned, 2) == ["returned at once", "ok"]
