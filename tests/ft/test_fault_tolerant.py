"""The fault-tolerant mode for real: a torchft lighthouse in this process, replicas as real processes on loopback.

Each replica runs tests/ft/_replica.py (a small Trial whose callbacks are
``distributed_callbacks(fault_tolerant=...)``) in its own session; every session is killed when its test
ends, and the lighthouse (Rust threads of this process) is shut down, so nothing outlives a test.
"""
import os
import signal
import time

import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas, kill_one_and_heal, train_together  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: Seconds of torchft's own bounds on a lost replica: the lighthouse's heartbeat timeout (2 s here) and a
#: collective's timeout (10 s) for a peer that hangs. (The join timeout, 15 s here, is for live replicas.)
LOST_BOUND = 2 + 10


@pytest.mark.timeout(300)
def test_kill_one_of_three_the_others_go_on_and_the_restarted_one_heals_bit_identical(replicas):
    stall = kill_one_and_heal(replicas, LOST_BOUND + LOAD_SLACK)
    print('survivors went on {:.1f} s after the kill'.format(stall))


def test_an_unreachable_lighthouse_is_named_in_one_line_within_its_bound(replicas, tmp_path):
    import socket
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    replicas.lighthouse = '127.0.0.1:{}'.format(port)
    started = time.monotonic()
    i = replicas.start(0, '--timeout', '3')
    assert replicas.process(i).wait(STARTUP + 3 + LOAD_SLACK) == 1
    elapsed = time.monotonic() - started
    lines = replicas.err(i).strip().splitlines()
    assert lines[-1] == ('error: the lighthouse at http://127.0.0.1:{} did not answer within 3 s; start it (python -m '
                         'torchbearer_dist.ft --min-replicas N) or pass its address'.format(port)), lines
    assert elapsed < STARTUP + 3 + LOAD_SLACK


@pytest.mark.timeout(240)
def test_a_replica_that_cannot_heal_fails_alone_in_one_line(replicas):
    # 3 epochs of 60 steps, long enough for the other replica to start while it trains.
    healthy = replicas.start(0, '--replicas', '2', '--epochs', '3', '--samples', '1200', '--sleep', '0.15')
    replicas.wait_for(lambda: replicas.steps(healthy) >= 10, STARTUP + 60)
    other = replicas.start(1, '--replicas', '2', '--epochs', '3', '--samples', '1200', '--hidden', '16')
    assert replicas.process(other).wait(STARTUP + LOST_BOUND + LOAD_SLACK) == 1, replicas.describe()
    assert replicas.err(other).strip().splitlines()[-1] == (
        'error: this replica cannot heal from a healthy replica: state[model].0.bias is [32] float32 there and [16] '
        'float32 here; start every replica with the same model')
    # The healthy replica goes on alone to the end of its run.
    replicas.wait_for(lambda: replicas.done(healthy), STARTUP + 120)
    assert replicas.process(healthy).wait(30) == 0
    assert replicas.steps(healthy) == 180


@pytest.mark.timeout(180)
def test_a_lighthouse_shut_down_in_process_stops_every_replica_in_one_line_within_its_timeout(tmp_path):
    # Lighthouse.shutdown() stops listening (the lighthouse killed with its process: tests/ft/test_lighthouse.py).
    server = Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0)
    replicas = Replicas(tmp_path, server.address)
    try:
        started = [replicas.start(r, '--replicas', '2', '--epochs', '50', '--timeout', '3') for r in range(2)]
        replicas.wait_for(lambda: min(replicas.steps(i) for i in started) >= 10, STARTUP + 60)
        server.shutdown()
        lost = time.monotonic()
        line = ('error: the lighthouse at {} was lost: nothing answered there for 3 s; start it there again (python -m '
                'torchbearer_dist.ft --min-replicas N) and restart every replica (a lighthouse back within 3 s is '
                'rejoined)'.format(server.address))
        # Bound: the timeout (3 s) and the load's slack; the process ends when torchft's quorum thread gives up.
        replicas.wait_for(lambda: all(line in replicas.err(i) for i in started), 3 + LOAD_SLACK)
        print('every replica said so {:.1f} s after the shutdown'.format(time.monotonic() - lost))
        for i in started:
            assert replicas.process(i).wait(3 * 3 + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(i).strip().splitlines()[-1] == line, replicas.describe()
    finally:
        server.shutdown()
        replicas.kill_all()


def test_too_few_replicas_wait_then_say_why(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=1.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            i = replicas.start(0, '--timeout', '3')
            assert replicas.process(i).wait(STARTUP + 9 + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(i).strip().splitlines()[-1].startswith(
                'error: no quorum within 9 s at the lighthouse {}: fewer live replicas than the minimum (its '
                '--min-replicas, or min_replicas=1 here); start more replicas or lower the minimum ('.format(
                    server.address)), replicas.describe()
        finally:
            replicas.kill_all()


@pytest.mark.timeout(180)
@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_ends_that_replica_at_once_and_the_other_goes_on(replicas, signum):
    started = [replicas.start(r, '--replicas', '2', '--epochs', '3', '--sleep', '0.05') for r in range(2)]
    replicas.wait_for(lambda: min(replicas.steps(i) for i in started) >= 20, STARTUP + 60)
    os.kill(replicas.process(started[1]).pid, signum)
    # Ended by the package within its grace (tests/ft/test_signals.py), not by the signal's default action: the
    # status a shell shows for that signal, 128 + its number, whether the stop unwound or was ended for it.
    assert replicas.process(started[1]).wait(5 + LOAD_SLACK) == 128 + signum  # no thread of torchft keeps it alive
    before = replicas.steps(started[0])
    replicas.wait_for(lambda: replicas.steps(started[0]) >= before + 10, LOST_BOUND + LOAD_SLACK)
    assert replicas.process(started[0]).poll() is None


@pytest.mark.timeout(180)
def test_checkpoints_are_written_by_one_live_replica(tmp_path):
    paths = [tmp_path / 'r{}.ckpt'.format(r) for r in range(2)]
    # min_replicas=2: both train every step together (with 1, the first to start could finish alone).
    replicas = train_together(tmp_path, [('--epochs', '2', '--samples', '400', '--checkpoint', str(p)) for p in paths],
                              STARTUP + 120)
    assert replicas.done(0)[0] == replicas.done(1)[0], replicas.describe()
    assert sorted(p.exists() for p in paths) == [False, True], replicas.describe()


def test_a_run_that_finds_no_lighthouse_gives_back_the_signal_handlers_it_found():
    # In this process, as in a notebook: the run installs its Ctrl-C and SIGTERM handlers before it looks for the
    # lighthouse; where that raised they stayed (the full suite's next test on the worker found SIGINT changed).
    import socket

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torchbearer import Trial

    import torchbearer_dist as tbd
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    trial = Trial(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                  torch.nn.CrossEntropyLoss(),
                  callbacks=tbd.distributed_callbacks(fault_tolerant='127.0.0.1:{}'.format(port), timeout=0.5))
    trial.with_generators(DataLoader(TensorDataset(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))))
    error = None
    try:
        trial.run(1, verbose=0)
    except RuntimeError as caught:
        error = caught  # its traceback holds the run's state alive, as a notebook's last exception does
    assert str(error).startswith('the lighthouse at http://127.0.0.1:{} did not answer within 0.5 s'.format(port))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
