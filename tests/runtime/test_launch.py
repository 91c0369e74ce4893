"""launch(): results in rank order, the failing rank's own error re-raised with its rank, under spawn and forkserver."""
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

import torchbearer_dist

from _dist import launch_workers, run_command


def _worker_rank_and_sum():
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), os.environ['WORLD_SIZE'], tensor.item()


def _worker_rank1_raises_after_rank0_returned():
    if dist.get_rank() == 1:
        raise KeyError('missing on rank 1')  # not a one-string-argument message exception
    return 'rank 0 finished'


def _worker_rank1_raises_in_collective_phase():
    if dist.get_rank() == 1:
        raise ValueError('bad batch')
    dist.barrier()  # rank 0 waits here until rank 1's failure breaks the group


#: What differs between start methods is how a rank starts (its stderr, its death with the launcher);
#: how launch reads the ranks' reports does not: the tests of reports run under forkserver only.
START_METHODS = pytest.mark.parametrize('start_method', ['spawn', 'forkserver'])


@START_METHODS
def test_results_come_back_in_rank_order(start_method):
    assert launch_workers(_worker_rank_and_sum, world_size=3, start_method=start_method) == [
        (0, '3', 6.0), (1, '3', 6.0), (2, '3', 6.0)]


def test_failing_rank_is_named_even_when_another_rank_returned():
    with pytest.raises(KeyError, match='rank 1 failed'):
        launch_workers(_worker_rank1_raises_after_rank0_returned)


def test_root_cause_is_the_failing_rank_not_the_peer_it_broke():
    with pytest.raises(ValueError, match=r'^rank 1 failed: bad batch$') as info:
        launch_workers(_worker_rank1_raises_in_collective_phase)
    assert 'traceback of rank 1' in str(info.value.__cause__)


def _worker_rank1_dies_after_a_line_on_stderr():
    if dist.get_rank() == 1:
        print('rank 1 is about to crash in native code', file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@START_METHODS
def test_a_rank_that_dies_without_reporting_leaves_its_last_stderr_line(start_method):
    # A forkserver's rank does not inherit the launcher's file descriptor 2: its pipe is an argument.
    with pytest.raises(RuntimeError, match=r'^rank 1 was killed by SIGKILL before reporting an error; its last lines '
                                           r'on stderr: rank 1 is about to crash in native code\n'):
        launch_workers(_worker_rank1_dies_after_a_line_on_stderr, start_method=start_method, rendezvous_timeout=5)


_KILLED_PEER_PROGRAM = '''
import multiprocessing, os, signal, sys
import torch
import torch.distributed as dist
import torchbearer_dist

def work():
    if dist.get_rank() == 0:  # a semaphore alive at the fault, as the one tqdm.write makes for its lock
        lock = multiprocessing.Lock()
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 learns of the death here, reports it, and exits

if __name__ == '__main__':
    try:
        torchbearer_dist.launch(work, 2, start_method=sys.argv[1], rendezvous_timeout=5)
    except RuntimeError as error:
        sys.stderr.write('error: {}\\n'.format(str(error).splitlines()[0]))
        sys.exit(1)
'''


@START_METHODS
def test_the_cause_of_a_killed_rank_is_the_last_line_the_user_sees(tmp_path, start_method):
    # A rank that reports an error exits at once (os._exit): multiprocessing's exit finalizers, which
    # unlink the rank's semaphores, ran only on success, and the launcher's resource tracker then warned
    # "There appear to be 1 leaked semaphore objects" after the launcher's cause, at the program's exit.
    script = tmp_path / 'killed_peer.py'
    script.write_text(_KILLED_PEER_PROGRAM)
    result = run_command([sys.executable, str(script), start_method], timeout=120, cwd=str(tmp_path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr[-3000:]
    assert lines[-1] == 'error: rank 1 was killed by SIGKILL before reporting an error', result.stderr[-3000:]


@pytest.mark.parametrize('world_size', [0, -1, 1.5, True, '2'])
def test_bad_world_size_is_refused_before_starting_anything(world_size):
    with pytest.raises(ValueError, match=r'world_size should be an integer >= 1, but given'):
        torchbearer_dist.launch(_worker_rank_and_sum, world_size)
