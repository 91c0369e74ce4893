"""A rank that did not run for a while: stopped by a signal (Ctrl-Z, ``kill -STOP``), then continued.

A pause longer than the rendezvous timeout looks like a lost rank to the others, and they end the
job naming it; the paused rank itself, once it runs again, names its own pause rather than blaming
rank 0, which it could not hear from meanwhile. A pause of the whole job (a machine that sleeps and
wakes) looks like nothing to anyone, and training goes on. Hand-started ranks, as in
``test_faults.py``.
"""
import os
import re
import signal
import time

import pytest

from _dist import free_port
from _fault_rank import RENDEZVOUS_TIMEOUT
from _faults import DEAD_PEER_BOUND, _assert_gone, _error_lines, _kill_all, _start_job, _wait_all

PAUSE = RENDEZVOUS_TIMEOUT + 3


def _pause(ranks, seconds):
    for process in ranks:
        os.kill(process.pid, signal.SIGSTOP)
    time.sleep(seconds)
    for process in ranks:
        os.kill(process.pid, signal.SIGCONT)


#: The collective timeout of the paused rank's job. A gloo collective that was in flight when the
#: rank stopped can outlive its peer's exit and go on waiting after the rank continues, until this
#: timeout (about 1 run in 4 here; shutting its connections down finds none left).
SHORT_TIMEOUT = 15


@pytest.mark.slow
def test_a_rank_paused_past_the_rendezvous_timeout_names_its_own_pause():
    port = free_port()
    ranks = _start_job(port, '--epochs', 50, '--step-delay', 0.02, timeout=SHORT_TIMEOUT)
    try:
        _pause(ranks[1:], PAUSE)
        _, results = _wait_all(ranks, SHORT_TIMEOUT + DEAD_PEER_BOUND + 10)
        (rc0, err0), (rc1, err1) = results
        assert (rc0, rc1) == (1, 1), (err0, err1)
        assert _error_lines(err0) == [
            'error: no heartbeat from rank 1 for {} s: its host is down or the network is partitioned (a rank that '
            'is merely busy keeps beating); check that host and the network, or raise rendezvous_timeout= (rank 0 '
            'stopped)'.format(RENDEZVOUS_TIMEOUT)], err0
        lines = _error_lines(err1)
        assert len(lines) == 1 and re.fullmatch(
            r'error: rank 1 did not run for (\d+) s, longer than the rendezvous timeout \({} s\), and the other ranks '
            r'took it for lost: it was stopped \(Ctrl-Z, kill -STOP\), its machine was paused, or its main thread held '
            r'the GIL in one native call; let it run, or raise rendezvous_timeout= \(rank 1 stopped\)'.format(
                RENDEZVOUS_TIMEOUT), lines[0]), err1
        assert int(re.search(r'did not run for (\d+) s', lines[0]).group(1)) >= PAUSE - 1, lines[0]
        _assert_gone(ranks, port)
    finally:
        _kill_all(ranks)


@pytest.mark.slow
def test_a_whole_job_paused_past_the_rendezvous_timeout_trains_on():
    # before the watch thread judged only what it read after a pause: 4 jobs in 4 ended, each rank blaming the other
    port = free_port()
    ranks = _start_job(port, '--epochs', 6, '--step-delay', 0.02)
    try:
        _pause(ranks, PAUSE)
        _, results = _wait_all(ranks, 90)
        assert [rc for rc, _ in results] == [0, 0], [err for _, err in results]
        assert not any(_error_lines(err) for _, err in results), results
    finally:
        _kill_all(ranks)


@pytest.mark.slow
def test_a_rank_slowed_and_paused_within_the_rendezvous_timeout_trains_to_the_end():
    """A healthy job with one slow rank: rank 1 first stops for most of the rendezvous timeout, then runs a
    quarter of the time (stopped 0.3 s in every 0.4 s) until the end, as under a load that starves it. Nobody
    is named; both ranks train every epoch and exit 0."""
    port = free_port()
    ranks = _start_job(port, '--epochs', 8, '--step-delay', 0.02)
    slowed = ranks[1]
    deadline = time.monotonic() + 150
    try:
        stop = RENDEZVOUS_TIMEOUT * 0.7
        while slowed.poll() is None and time.monotonic() < deadline:
            os.kill(slowed.pid, signal.SIGSTOP)
            time.sleep(stop)
            os.kill(slowed.pid, signal.SIGCONT)
            time.sleep(0.1)
            stop = 0.3
        _, results = _wait_all(ranks, max(1.0, deadline - time.monotonic()))
        assert [rc for rc, _ in results] == [0, 0], [err for _, err in results]
        assert not any(_error_lines(err) for _, err in results), results
    finally:
        if slowed.poll() is None:
            os.kill(slowed.pid, signal.SIGCONT)
        _kill_all(ranks)
