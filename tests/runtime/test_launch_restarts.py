"""launch(max_restarts=R): torchrun's restart policy. After a failure every rank starts again, on a new port (or the
port given), each told which start it is in ``TORCHELASTIC_RESTART_COUNT``, up to R times with one line each on
stderr; then the last start's error as without restarts. The user's stop and the deadline are not restarted.

Each rank appends ``<start> <port>`` to a file, so that a test counts the starts that ran.
"""
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

import torchbearer_dist

from _dist import PG_TIMEOUT, STARTUP, free_port, launch_workers

#: A backstop only: launch's own deadline (launch_workers') ends a hung test first.
BACKSTOP = 4 * STARTUP


def _log_start(log):
    """Append this start's number and port to ``log``; return the start number (a string, as in the environment)."""
    start = os.environ['TORCHELASTIC_RESTART_COUNT']
    with open(log, 'a') as f:
        f.write('{} {}\n'.format(start, os.environ['MASTER_PORT']))
    return start


def _starts(log):
    """``[(start, port)]`` as the ranks logged them."""
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def _restart_lines(err):
    return [line for line in err.splitlines() if 'again (restart' in line]


def _worker_rank1_fails_in_the_first_start(log):
    start = _log_start(log) if dist.get_rank() == 1 else os.environ['TORCHELASTIC_RESTART_COUNT']
    if dist.get_rank() == 1 and start == '0':
        raise ValueError('fails in the first start')
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)  # rank 0 of the first start waits here until rank 1's failure breaks the group
    return dist.get_rank(), start, tensor.item()


@pytest.mark.timeout(BACKSTOP)
@pytest.mark.parametrize('fixed_port', [False, True], ids=['new-port', 'port-given'])
def test_a_failed_start_is_started_again_and_its_results_come_back(tmp_path, capsys, fixed_port):
    log = tmp_path / 'starts'
    port = free_port() if fixed_port else None
    started = time.monotonic()
    results = launch_workers(_worker_rank1_fails_in_the_first_start, 2, args=(str(log),), port=port, max_restarts=2)
    print('two starts, one restart: {:.1f} s'.format(time.monotonic() - started))
    assert results == [(0, '1', 3.0), (1, '1', 3.0)]  # the second start's
    starts = _starts(log)
    assert [start for start, _ in starts] == ['0', '1']
    if fixed_port:
        assert [int(p) for _, p in starts] == [port, port]
    else:  # a new rendezvous: no rank of the second start can meet the first's store
        assert starts[0][1] != starts[1][1], starts
    assert _restart_lines(capsys.readouterr().err) == [
        'torchbearer_dist: rank 1 failed: fails in the first start; starting the 2 ranks again (restart 1 of 2)']


def _worker_rank1_fails_at_every_start(log):
    if dist.get_rank() == 1:
        _log_start(log)
        raise ValueError('fails at every start')
    dist.barrier()


@pytest.mark.timeout(BACKSTOP)
def test_when_every_start_fails_the_last_error_is_raised_after_r_restarts(tmp_path, capsys):
    log = tmp_path / 'starts'
    started = time.monotonic()
    with pytest.raises(ValueError, match=r'^rank 1 failed: fails at every start$') as info:
        launch_workers(_worker_rank1_fails_at_every_start, 2, args=(str(log),), max_restarts=2)
    print('three starts, two restarts: {:.1f} s'.format(time.monotonic() - started))
    assert 'traceback of rank 1' in str(info.value.__cause__)  # raised as without restarts
    assert [start for start, _ in _starts(log)] == ['0', '1', '2']  # R + 1 starts
    assert _restart_lines(capsys.readouterr().err) == [
        'torchbearer_dist: rank 1 failed: fails at every start; starting the 2 ranks again (restart {} of 2)'.format(n)
        for n in (1, 2)]


def _worker_rank1_stopped_by_ctrl_c(log):
    if dist.get_rank() == 1:
        _log_start(log)
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C of this rank alone: the user's stop
        time.sleep(30)
    dist.barrier()


def _worker_past_the_deadline(log):
    _log_start(log)
    time.sleep(60)


@pytest.mark.timeout(BACKSTOP)
@pytest.mark.parametrize('stop', ['ctrl-c', 'deadline'])
def test_the_users_stop_and_the_deadline_are_not_restarted(tmp_path, capsys, stop):
    log = tmp_path / 'starts'
    if stop == 'ctrl-c':
        with pytest.raises(RuntimeError, match=r'^rank 1 failed: KeyboardInterrupt'):
            launch_workers(_worker_rank1_stopped_by_ctrl_c, 2, args=(str(log),), max_restarts=2)
        assert [start for start, _ in _starts(log)] == ['0']
    else:
        with pytest.raises(RuntimeError, match=r'still running after the [0-9.]+ s deadline; stopped them'):
            torchbearer_dist.launch(_worker_past_the_deadline, 2, args=(str(log),), timeout=PG_TIMEOUT,
                                    deadline=4, start_method='forkserver', max_restarts=2)
        assert {start for start, _ in _starts(log)} <= {'0'}  # the first start only (reached its function or not)
    assert _restart_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize('max_restarts', [-1, 1.5, True, '2', None])
def test_bad_max_restarts_is_refused_before_starting_anything(tmp_path, max_restarts):
    with pytest.raises(ValueError, match=r'^max_restarts should be an integer >= 0, but given {}$'.format(
            re.escape(repr(max_restarts)))):
        torchbearer_dist.launch(_worker_rank1_fails_at_every_start, 2, args=(str(tmp_path / 'starts'),),
                                max_restarts=max_restarts)
    assert not (tmp_path / 'starts').exists()


def test_a_function_that_cannot_be_started_is_not_restarted(capsys):
    with pytest.raises(Exception, match='pickle'):
        torchbearer_dist.launch(lambda: None, 2, start_method='spawn', max_restarts=2)
    assert _restart_lines(capsys.readouterr().err) == []
