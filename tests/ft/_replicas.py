"""Replica processes of the fault-tolerant tests (tests/ft/_replica.py), each in its own session, its output in files.

Every session is killed when a test ends (:meth:`Replicas.kill_all`), so nothing outlives it.
"""
import os
import signal
import subprocess
import time

from _dist import STARTUP, HangGuard, child_env, descendants, kill_session, python

HERE = os.path.dirname(os.path.abspath(__file__))


class Replicas:
    """Replica processes of one test, each in its own session, with its output in a file; all killed at the end."""

    def __init__(self, tmp_path, lighthouse, hosts=None):
        self.tmp_path, self.lighthouse, self.hosts = tmp_path, lighthouse, hosts
        self.started = []  # (process, stdout path, stderr path)

    def start(self, replica, *args):
        """Start replica ``replica`` (on host ``replica`` of ``hosts``, if given); returns its index in ``started``."""
        out, err = (self.tmp_path / 'r{}-{}.{}'.format(replica, len(self.started), kind) for kind in ('out', 'err'))
        command = python(os.path.join(HERE, '_replica.py'), '--lighthouse', self.lighthouse, '--replica', str(replica),
                         *args)
        env = child_env(RUST_LOG='warn')
        if self.hosts is not None:  # gloo on the host's own link: its host name resolves outside the namespace
            command, env['GLOO_SOCKET_IFNAME'] = self.hosts.command(replica, command), self.hosts.links[replica]
        with open(out, 'w') as stdout, open(err, 'w') as stderr:
            process = subprocess.Popen(command, stdout=stdout, stderr=stderr, start_new_session=True, env=env)
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

    def position(self, i, per_epoch=60):
        """The run's step that replica ``i`` trained last, counted from the run's start (0: none yet)."""
        lines = [line.split() for line in self.out(i).splitlines() if line.startswith('STEP ')]
        return int(lines[-1][1]) * per_epoch + int(lines[-1][2]) + 1 if lines else 0

    def wait_for(self, what, deadline, starting=()):
        """Poll ``what()`` until true; fail at ``deadline`` seconds with every replica's output.

        Args:
            starting: the replicas (indices in ``started``) that the wait waits on to start up (import torch, build
                their Manager, a launcher's ranks): past ``deadline`` it goes on while their processes, a launcher's
                workers included, still use the CPU (:class:`HangGuard`), so a machine that load slows is no fault
                while a start that hangs fails at ``deadline``. A fault's own bound is never stretched.
        """
        guard = HangGuard(deadline)
        while not what():
            guard.pids = [pid for i in starting for pid in descendants(self.process(i).pid)]
            if guard.expired() if starting else time.monotonic() - guard.started > deadline:
                raise AssertionError('still waiting {}:\n{}'.format(
                    guard.describe() if starting else 'after {} s'.format(deadline), self.describe()))
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


def train_together(tmp_path, args, deadline, hosts=None):
    """Replicas ``0 .. len(args) - 1``, replica ``r`` with the options ``args[r]``, all in every quorum from the
    first step (a lighthouse of ``min_replicas=len(args)``) to the end of their runs, each ending with status 0;
    with ``hosts``, each replica runs where :class:`Replicas` puts it (a launcher of a replica group, say).

    Returns:
        Replicas: the replicas, all ended, replica ``r`` at index ``r``
    """
    from torchbearer_dist.ft import Lighthouse
    with Lighthouse(bind='127.0.0.1:0', min_replicas=len(args), join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address, hosts=hosts)
        try:
            started = [replicas.start(r, '--replicas', str(len(args)), *own) for r, own in enumerate(args)]
            replicas.wait_for(lambda: all(replicas.process(i).poll() is not None or
                                          (hosts is None and replicas.done(i)) for i in started), deadline)
            assert all(replicas.process(i).wait(30) == 0 for i in started), replicas.describe()
        finally:
            replicas.kill_all()
    return replicas


def kill_one_and_heal(replicas, lost_bound, *extra):
    """Three replicas, 60 steps per epoch, 2 epochs; replica 1 killed with SIGKILL past the run's 20th step (before
    the 80th, where the survivors wait for its replacement; however late it joined), then restarted.

    ``extra``: more options of every replica. Asserts that the survivors go on within ``lost_bound`` seconds
    without restarting, and that the restarted one heals and ends with the survivors' weights, bit for bit,
    and their metrics.

    Returns:
        float: seconds from the kill until both survivors had trained 3 more steps
    """
    args = ('--epochs', '2', '--sleep', '0.05', *extra)
    gate = str(replicas.tmp_path / 'gate')  # the survivors hold at the run's 80th step until the replacement is up
    first = [replicas.start(r, *args, '--gate', gate, '--gate-step', '80') for r in range(3)]
    replicas.wait_for(lambda: replicas.position(first[1]) >= 20, STARTUP + 60)
    os.kill(replicas.process(first[1]).pid, signal.SIGKILL)
    killed_at, before = time.monotonic(), [replicas.steps(i) for i in (first[0], first[2])]
    replicas.wait_for(lambda: min(replicas.steps(first[0]) - before[0], replicas.steps(first[2]) - before[1]) >= 3,
                      lost_bound)
    stall = time.monotonic() - killed_at
    assert all(replicas.process(i).poll() is None for i in (first[0], first[2])), replicas.describe()
    restarted = replicas.start(1, *args)
    replicas.wait_for(lambda: 'READY' in replicas.out(restarted), STARTUP + 60)
    open(gate, 'w').close()
    replicas.wait_for(lambda: all(replicas.done(i) for i in (first[0], first[2], restarted)), STARTUP + 180)
    digests = {i: replicas.done(i) for i in (first[0], first[2], restarted)}
    # The survivors never restarted: the DONE line comes from the very processes started first.
    for i in (first[0], first[2]):
        code = replicas.process(i).wait(30)  # once in three clean-clone runs a survivor exited non-zero: say how
        assert int(digests[i][2]) == replicas.process(i).pid and code == 0, (i, code, replicas.describe())
    assert replicas.process(restarted).wait(30) == 0, replicas.describe()
    assert int(digests[restarted][1]) >= 1, 'the restarted replica did not heal: {}'.format(replicas.describe())
    # Bit-identical weights on all three, and the same global metrics.
    assert len({d[0] for d in digests.values()}) == 1, digests
    assert len({d[3] for d in digests.values()}) == 1, digests
    # The restarted one took up the survivors' position: it trained fewer steps than a whole run (120).
    assert replicas.steps(restarted) < 120 - 20
    return stall


def late_joiner(tmp_path, local_steps, gate_step, first=(), late=()):
    """DiLoCo's late start: replica 0 trains 3 epochs of 6 steps with ``local_steps``, holding at its ``gate_step``-th
    step until replica 1, started then, asks for its first quorum; both end with status 0, replica 1 healed once,
    with replica 0's weights and last metrics. ``first``, ``late``: more options of each.

    Returns:
        tuple: the :class:`Replicas` (ended), and replica 1's index in it
    """
    from torchbearer_dist.ft import Lighthouse
    args = ('--replicas', '2', '--samples', '120', '--epochs', '3', '--local-steps', str(local_steps),
            '--sleep', '0.05')
    gate = str(tmp_path / 'gate')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            started = replicas.start(0, *args, '--gate', gate, '--gate-step', str(gate_step), *first)
            replicas.wait_for(lambda: replicas.steps(started) >= gate_step, STARTUP + 60)
            joiner = replicas.start(1, *args, *late)
            replicas.wait_for(lambda: 'READY' in replicas.out(joiner), STARTUP + 60)
            open(gate, 'w').close()
            replicas.wait_for(lambda: replicas.done(started) and replicas.done(joiner), STARTUP + 60)
            assert [replicas.process(i).wait(30) for i in (started, joiner)] == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    assert int(replicas.done(joiner)[1]) == 1, replicas.describe()  # healed once
    assert replicas.steps(started) == 18, replicas.describe()
    assert replicas.done(started)[0] == replicas.done(joiner)[0], replicas.describe()  # the same weights, bit for bit
    assert replicas.done(started)[3] == replicas.done(joiner)[3], replicas.describe()  # the same last metrics
    return replicas, joiner
