"""A replica restarted by torchrun rejoins live (issue 33, item 3): the fault-tolerant mode under ``--max-restarts``.

Each of two replicas is its own ``torchrun --standalone --nproc-per-node 1 --max-restarts 2`` job of
tests/ft/_replica.py (``distributed_callbacks(fault_tolerant=...)``, world size 1 in torchrun's
environment) beside a real lighthouse. The worker of replica 1 (torchrun's child, not its agent) is killed
with SIGKILL mid-run: its agent starts a new worker, which heals from replica 0 and trains the rest of
the run beside it, while replica 0's worker goes on without ever restarting; both end bit-identical.

torchrun starts each worker in a session of its own, so killing an agent's session leaves its worker
running: :func:`_stop` stops the agent first (no new worker can start), then kills it and every worker's
session, and the test checks that nothing of them is left.
"""
import os
import signal
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, TORCHRUN, children, cmdline, kill_session, session

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: As in test_fault_tolerant.py: the lighthouse's heartbeat timeout (2 s) and a collective's timeout (10 s).
LOST_BOUND = 2 + 10
#: The test's own hard bound, seconds: two torchrun jobs, a restart and 120 short steps take about 35 s idle.
HARD_TIMEOUT = 90
#: 1200 samples over 2 replicas at batch 10: 60 steps per epoch, 2 epochs.
ARGS = ('--replicas', '2', '--samples', '1200', '--epochs', '2', '--sleep', '0.05')


class Torchrun:
    """Where :class:`~_replicas.Replicas` runs replica ``i``'s command: in a torchrun job of one worker, with
    restarts (its ``hosts`` hook; gloo on loopback)."""

    links = ('lo', 'lo')

    def command(self, replica, argv):
        return [*TORCHRUN, '--standalone', '--nproc-per-node', '1', '--max-restarts', '2', '--monitor-interval',
                '0.2', *argv[1:]]  # argv[0] is this Python, which TORCHRUN runs


def _worker(agent):
    """The pid of the one live worker of torchrun agent ``agent`` (a process), or None."""
    found = [pid for pid in children(agent.pid) if '_replica.py' in cmdline(pid)]
    assert len(found) <= 1, found
    return found[0] if found else None


def _stop(agents, workers):
    """SIGSTOP every agent (none starts another worker), then SIGKILL the agents' and every worker's session."""
    for agent in agents:
        try:
            os.killpg(agent.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass
    for agent in agents:
        workers |= set(children(agent.pid))
        kill_session(agent.pid)
    for pid in workers:
        kill_session(pid)  # torchrun's worker leads a session of its own


@pytest.mark.slow
@pytest.mark.timeout(HARD_TIMEOUT + 30)  # a backstop only: the waits below end the test by HARD_TIMEOUT
def test_a_worker_killed_under_torchrun_restarts_heals_live_and_ends_bit_identical(tmp_path):
    end = time.monotonic() + HARD_TIMEOUT

    def within(seconds):
        return max(1.0, min(seconds, end - time.monotonic()))

    start, gate = str(tmp_path / 'start'), str(tmp_path / 'gate')
    workers = set()
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Torchrun())
        try:
            # Replica 1 first, held after its first step until replica 0 is up: neither trains far alone (a
            # torchrun job starts two Pythons, seconds apart under load), and replica 0 joins it at its next step.
            restarted = replicas.start(1, *ARGS, '--gate', start, '--gate-step', '1')
            replicas.wait_for(lambda: replicas.steps(restarted) >= 1, within(STARTUP + LOAD_SLACK))
            survivor = replicas.start(0, *ARGS, '--gate', gate, '--gate-step', '40')  # held for the restart
            replicas.wait_for(lambda: 'READY' in replicas.out(survivor), within(STARTUP + LOAD_SLACK))
            open(start, 'w').close()
            replicas.wait_for(lambda: min(replicas.steps(survivor), replicas.steps(restarted)) >= 20,
                              within(STARTUP))
            first = {i: _worker(replicas.process(i)) for i in (survivor, restarted)}
            workers |= set(first.values())
            assert None not in first.values(), replicas.describe()

            os.kill(first[restarted], signal.SIGKILL)  # the worker, not torchrun's agent
            killed_at, before = time.monotonic(), replicas.steps(survivor)
            replicas.wait_for(lambda: replicas.steps(survivor) - before >= 3, within(LOST_BOUND + LOAD_SLACK))
            print('the survivor went on {:.1f} s after the kill'.format(time.monotonic() - killed_at))

            # torchrun's agent starts a new worker of replica 1 (its start gate open): it heals from the survivor,
            # which waits at its step 40.
            replicas.wait_for(lambda: replicas.out(restarted).count('READY') == 2, within(STARTUP + LOAD_SLACK))
            second = _worker(replicas.process(restarted))
            workers.add(second)
            assert second not in (None, first[restarted]), replicas.describe()
            open(gate, 'w').close()
            replicas.wait_for(lambda: replicas.done(survivor) and replicas.done(restarted), within(STARTUP + 60))
            codes = [replicas.process(i).wait(within(30)) for i in (survivor, restarted)]
            assert codes == [0, 0], replicas.describe()
        finally:
            _stop([process for process, _, _ in replicas.started], workers)
            replicas.kill_all()
    assert not [pid for sid in workers for pid in session(sid)], 'a worker outlived the test'

    done = {i: replicas.done(i) for i in (survivor, restarted)}  # weights hash, heals, pid, metrics
    # The survivor's worker never restarted: one start, and its DONE line comes from the first worker.
    assert replicas.out(survivor).count('READY') == 1 and int(done[survivor][2]) == first[survivor], done
    # Replica 1 ended in the worker torchrun started after the kill, which healed from the survivor and took up its
    # position (fewer steps than the 120 of a whole run, the 20 before the kill left out).
    assert int(done[restarted][2]) == second and int(done[restarted][1]) >= 1, done
    assert replicas.out(restarted).split('READY')[-1].count('STEP ') < 120 - 20
    # Bit-identical weights, and the same global metrics.
    assert done[survivor][0] == done[restarted][0], done
    assert done[survivor][3] == done[restarted][3], done
