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


def test_all_reduce_matches_sum_of_ranks():
    assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]


def test_rank_error_is_reported_with_its_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[1\] failed.*--- rank 1:.*boom on rank 1"):
        run_ranks(_raise_on_rank_one, 2)
