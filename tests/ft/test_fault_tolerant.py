"""The fault-tolerant mode for real: a torchft lighthouse in this process, replicas as real processes on loopback.

Each replica runs tests/ft/_replica.py (a small Trial whose callbacks are
``distributed_callbacks(fault_tolerant=...)``) in its own session; every session is killed when its test
ends, and the lighthouse (Rust threads of this process) is shut down, so nothing outlives a test.
"""
import os
import signal
import subprocess
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, child_env, kill_session, python

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

HERE = os.path.dirname(os.path.abspath(__file__))
#: Seconds of torchft's own bounds on a lost replica: the lighthouse's heartbeat timeout (2 s here), then
#: the quorum's join timeout (4 s here) at most, and a collective's timeout (10 s) for a peer that hangs.
LOST_BOUND = 2 + 4 + 10


class Replicas:
    """Replica processes of one test, each in its own session, with its output in a file; all killed at the end."""

    def __init__(self, tmp_path, lighthouse):
        self.tmp_path, self.lighthouse = tmp_path, lighthouse
        self.started = []  # (process, stdout path, stderr path)

    def start(self, replica, *args):
        out, err = (self.tmp_path / 'r{}-{}.{}'.format(replica, len(self.started), kind) for kind in ('out', 'err'))
        with open(out, 'w') as stdout, open(err, 'w') as stderr:
            process = subprocess.Popen(python(os.path.join(HERE, '_replica.py'), '--lighthouse', self.lighthouse,
                                              '--replica', str(replica), *args),
                                       stdout=stdout, stderr=stderr, start_new_session=True,
                                       env=child_env(RUST_LOG='warn'))
        self.started.append((process, out, err))
        return len(self.started) - 1

    def process(self, i):
        return self.started[i][0]

    def out(self, i):
        return self.started[i][1].read_text()

    def err(self, i):
        return self.started[i][2].read_text()

    def steps(self, i):
        return self.out(i).count('STEP ')

    def wait_for(self, what, deadline, i=None):
        """Poll ``what()`` until true; fail at ``deadline`` seconds with every replica's output."""
        end = time.monotonic() + deadline
        while not what():
            if time.monotonic() > end:
                raise AssertionError('still waiting after {} s:\n{}'.format(deadline, self.describe()))
            time.sleep(0.1)

    def describe(self):
        return '\n'.join('--- {} (rc {}):\n{}\n{}'.format(p.pid, p.poll(), self.out(i)[-800:], self.err(i)[-1500:])
                         for i, (p, _, _) in enumerate(self.started))

    def done(self, i):
        lines = [line.split(' ', 4) for line in self.out(i).splitlines() if line.startswith('DONE ')]
        return lines[-1][1:] if lines else None

    def kill_all(self):
        for process, _, _ in self.started:
            kill_session(process.pid)
            process.wait()


@pytest.fixture
def lighthouse():
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=4.0, heartbeat_timeout=2.0) as server:
        yield server.address


@pytest.fixture
def replicas(tmp_path, lighthouse):
    started = Replicas(tmp_path, lighthouse)
    yield started
    started.kill_all()


@pytest.mark.timeout(300)
def test_kill_one_of_three_the_others_go_on_and_the_restarted_one_heals_bit_identical(replicas):
    # 3 replicas of 60 steps per epoch, 2 epochs; replica 1 killed with SIGKILL in its first epoch.
    args = ('--epochs', '2', '--sleep', '0.05')
    first = [replicas.start(r, *args) for r in range(3)]
    replicas.wait_for(lambda: replicas.steps(first[1]) >= 20, STARTUP + 60)
    os.kill(replicas.process(first[1]).pid, signal.SIGKILL)
    killed_at, before = time.monotonic(), [replicas.steps(i) for i in (first[0], first[2])]
    # The survivors go on without it, within torchft's bounds on a lost replica (measured, with headroom).
    replicas.wait_for(lambda: min(replicas.steps(first[0]) - before[0], replicas.steps(first[2]) - before[1]) >= 3,
                      LOST_BOUND + LOAD_SLACK)
    stall = time.monotonic() - killed_at
    assert all(replicas.process(i).poll() is None for i in (first[0], first[2])), replicas.describe()
    restarted = replicas.start(1, *args)
    replicas.wait_for(lambda: all(replicas.done(i) for i in (first[0], first[2], restarted)), STARTUP + 180)
    digests = {i: replicas.done(i) for i in (first[0], first[2], restarted)}
    # The survivors never restarted: the DONE line comes from the very processes started first.
    for i in (first[0], first[2]):
        assert int(digests[i][2]) == replicas.process(i).pid and replicas.process(i).wait(30) == 0
    assert replicas.process(restarted).wait(30) == 0, replicas.describe()
    assert int(digests[restarted][1]) >= 1, 'the restarted replica did not heal: {}'.format(replicas.describe())
    # Bit-identical weights on all three, and the same global metrics.
    assert len({d[0] for d in digests.values()}) == 1, digests
    assert len({d[3] for d in digests.values()}) == 1, digests
    # The restarted one took up the survivors' position: it trained fewer steps than a whole run (120).
    assert replicas.steps(restarted) < 120 - 20
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
def test_a_lost_lighthouse_stops_every_replica_in_one_line_within_its_bound(tmp_path):
    server = Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=4.0, heartbeat_timeout=2.0)
    replicas = Replicas(tmp_path, server.address)
    try:
        started = [replicas.start(r, '--replicas', '2', '--epochs', '50', '--timeout', '3') for r in range(2)]
        replicas.wait_for(lambda: min(replicas.steps(i) for i in started) >= 10, STARTUP + 60)
        server.shutdown()
        lost = time.monotonic()
        # Bound: the quorum's timeout (3 s), the probe of the lighthouse (3 s), and the load's slack.
        for i in started:
            assert replicas.process(i).wait(3 + 3 + LOAD_SLACK) == 1, replicas.describe()
        assert time.monotonic() - lost < 3 + 3 + LOAD_SLACK
        for i in started:
            assert replicas.err(i).strip().splitlines()[-1] == (
                'error: the lighthouse at {} did not answer within 3 s; start it (python -m torchbearer_dist.ft '
                '--min-replicas N) or pass its address'.format(server.address)), replicas.describe()
    finally:
        server.shutdown()
        replicas.kill_all()


def test_too_few_replicas_wait_then_say_why(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=1.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            i = replicas.start(0, '--timeout', '3')
            assert replicas.process(i).wait(STARTUP + 3 + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(i).strip().splitlines()[-1].startswith(
                'error: no quorum within 3 s at the lighthouse {}: fewer live replicas than the minimum (its '
                '--min-replicas, or min_replicas=1 here); start more replicas or lower the minimum ('.format(
                    server.address)), replicas.describe()
        finally:
            replicas.kill_all()
