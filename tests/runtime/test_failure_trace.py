"""How far a failure travels in the package before the user reads its one line (issue 44, item 2).

Two real ranks over gloo on loopback (``_fault_rank.py``'s Trial); rank 1 is SIGKILLed, or raises its own
error, in its training loop. Rank 0 runs under :func:`sys.setprofile` (``_traced_rank.py``): from the call
that hands its caught error to the runtime to the return of the error it raises, every function its main
thread calls is recorded. The failure may cross the applier, the fold, the words and the errors: four
modules of the package, no more.
"""
import os
import subprocess
import sys

import pytest

from _dist import LOAD_SLACK, ROOT, child_env, free_port
from _fault_rank import RENDEZVOUS_TIMEOUT, TIMEOUT
from _faults import CAUSE_WAIT, _error_lines, _kill_all, _start_rank, _wait_all, _wait_for_line

TRACED = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_traced_rank.py')
#: The modules a failure may cross on rank 0's main thread, from its detection to the user's line.
BOUND = 4


def _traced_job(tmp_path, fault):
    """Run rank 0 (traced) and rank 1 with ``fault`` on rank 1: ``(rank 0's error lines, its trace)``."""
    port, trace = free_port(), tmp_path / 'trace.txt'
    extra = ['--rendezvous-timeout', str(RENDEZVOUS_TIMEOUT), '--fault', fault, '--fault-rank', '1',
             '--epochs', '50']
    zero = subprocess.Popen([sys.executable, TRACED, str(trace), '--rank', '0', '--world-size', '2', '--host',
                             '127.0.0.1', '--port', str(port), '--timeout', str(TIMEOUT), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=child_env(), cwd=ROOT)
    ranks = [zero]
    try:
        ranks.append(_start_rank(1, port, *extra))
        for process in ranks:
            _wait_for_line(process, 'ready', timeout=90)
        _, results = _wait_all(ranks, RENDEZVOUS_TIMEOUT + CAUSE_WAIT + LOAD_SLACK + 20)
    finally:
        _kill_all(ranks)
    assert results[0][0] == 1, results
    return _error_lines(results[0][1]), trace.read_text().splitlines()


def _crossed(calls):
    """The package's modules the calls ran in, in order of first use, and how often a call changed module."""
    modules = [call.split()[0] for call in calls]
    return list(dict.fromkeys(modules)), sum(a != b for a, b in zip(modules, modules[1:]))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize('fault, line', [
    ('kill-train', 'error: rank 1 died without reporting an error: it was killed (by the OOM killer, or a signal) '
                   'or crashed in native code; see its log and dmesg (rank 0 stopped)'),
    ('raise-train', 'error: rank 1 failed: ValueError: boom in training on rank 1 (rank 0 stopped)')])
def test_a_peers_failure_crosses_at_most_four_modules_on_rank_0s_main_thread(tmp_path, fault, line):
    lines, calls = _traced_job(tmp_path, fault)
    assert lines == [line]
    modules, transitions = _crossed(calls)
    print('{}: {} modules, {} transitions, {} calls: {}'.format(fault, len(modules), transitions, len(calls),
                                                                 modules))
    assert calls, 'nothing traced: the process group no longer hands the error to the runtime as expected'
    assert len(modules) <= BOUND, (modules, calls)
