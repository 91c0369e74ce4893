"""The suite's own harness (tests/_dist.py run_workers), which shares no code with launch(): results in
rank order, and a failing rank's traceback re-raised with every other rank killed."""
import pytest
import torch
import torch.distributed as dist

from _dist import WorkerFailed, run_workers


def _worker_rank_and_sum():
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), dist.get_world_size(), tensor.item()


def _worker_rank1_raises_while_rank0_waits():
    if dist.get_rank() == 1:
        raise ValueError('bad batch on rank 1')
    dist.barrier()  # rank 0 would wait here for the collective timeout: the harness kills it first


def test_results_come_back_in_rank_order():
    assert run_workers(_worker_rank_and_sum, 3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_first_failure_is_reraised_with_its_traceback_and_the_waiting_rank_is_killed():
    with pytest.raises(WorkerFailed, match=r'(?s)^rank 1 failed:\n.*ValueError: bad batch on rank 1') as info:
        run_workers(_worker_rank1_raises_while_rank0_waits, 2, timeout=60, deadline=50)
    assert '_worker_rank1_raises_while_rank0_waits' in info.value.text
    # conftest's clean_process fixture fails the test if rank 0 outlived it
