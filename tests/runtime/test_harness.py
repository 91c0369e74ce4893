"""The suite's own harness (tests/_dist.py run_workers), which shares no code with launch(): results in
rank order, a failing rank's traceback re-raised with every other rank killed, and deadlines that bound
a hang, not the machine's speed."""
import sys
import time

import pytest
import torch
import torch.distributed as dist

import _dist
from _dist import WorkerFailed, run_command, run_workers


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


def _worker_rank0_sleeps():
    if dist.get_rank() == 0:
        time.sleep(600)  # a hang: no CPU used
    dist.barrier()


def _worker_busy_for(seconds):
    started = time.monotonic()
    while time.monotonic() - started < seconds:  # slow but progressing, as on a loaded machine
        pass
    return dist.get_rank()


@pytest.fixture
def short_window(monkeypatch):
    monkeypatch.setattr(_dist, 'PROGRESS_WINDOW', 2.0)


def test_a_hang_fails_at_its_deadline_naming_it(short_window):
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r'^ranks \[0, 1\] still running after the 3 s deadline, using under '
                                             r'0\.5 CPU-s in the last 2 s \(a hang\); killed every rank$'):
        run_workers(_worker_rank0_sleeps, 2, timeout=60, deadline=3)
    assert time.monotonic() - started < 3 * _dist.STRETCH  # the deadline, not the stretch


def test_a_slow_test_that_still_uses_the_cpu_runs_past_its_deadline(short_window):
    assert run_workers(_worker_busy_for, 2, args=(6,), deadline=3) == [0, 1]


def test_a_command_that_spins_ends_at_the_stretched_deadline(short_window):
    with pytest.raises(AssertionError, match=r'still running after \d+ s, 4x the 2 s deadline, still using the CPU'):
        run_command([sys.executable, '-c', 'while True: pass'], timeout=2)
