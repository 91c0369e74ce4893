"""A replica restarted by torchrun rejoins live (issue 33, item 3; a replica group of two ranks, issue 43): the
fault-tolerant mode under ``--max-restarts``, and under ``launch(max_restarts=R)``, which follows torchrun's policy.

Each of two replicas is its own ``torchrun --standalone --nproc-per-node 1 --max-restarts 2`` job of
tests/ft/_replica.py (``distributed_callbacks(fault_tolerant=...)``, world size 1 in torchrun's
environment) beside a real lighthouse. The worker of replica 1 (torchrun's child, not its agent) is killed
with SIGKILL mid-run: its agent starts a new worker, which heals from replica 0 and trains the rest of
the run beside it, while replica 0's worker goes on without ever restarting; both end bit-identical.

With ``--nproc-per-node 2`` each replica is a replica group of two ranks (their process group torchrun's): one
rank of replica 1 is killed, torchrun stops the other and starts the group again, whose two new ranks heal, each
from the same rank of replica 0; all four ranks end bit-identical, with the same metrics.

``group-of-two-under-launch`` runs the same scenario with each replica a ``launch(world_size=2, max_restarts=3)``
of tests/ft/_replica.py itself (``--launch 2``): launch() stops the group's other rank and starts both again, each
with ``TORCHELASTIC_RESTART_COUNT`` set, as torchrun does.

torchrun starts each worker in a session of its own, so killing an agent's session leaves its worker
running: :func:`_stop` stops the agent first (no new worker can start), then kills it and every worker's
session, and the test checks that nothing of them is left.
"""
import os
import re
import signal
import time

import pytest
import torch

from _dist import LOAD_SLACK, STARTUP, STRETCH, TORCHRUN, children, cmdline, kill_session, session

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: As in test_fault_tolerant.py: the lighthouse's heartbeat timeout (2 s) and a collective's timeout (10 s).
LOST_BOUND = 2 + 10
#: The test's own hard bound, seconds: two torchrun jobs, a restart and 120 short steps take about 35 s idle (a
#: group of two: 50 s at a load of 13).
HARD_TIMEOUT = 150
#: 1200 samples over 2 replicas at batch 10: 60 steps per epoch (30 in groups of two), 2 epochs.
ARGS = ('--replicas', '2', '--samples', '1200', '--epochs', '2', '--sleep', '0.05')


class Torchrun:
    """Where :class:`~_replicas.Replicas` runs replica ``i``'s command: in a torchrun job of ``ranks`` workers (a
    replica group), with ``restarts`` restarts (its ``hosts`` hook; gloo on loopback)."""

    links = ('lo', 'lo')

    def __init__(self, ranks=1, restarts=2):
        self.ranks, self.restarts = ranks, restarts

    def command(self, replica, argv):
        return [*TORCHRUN, '--standalone', '--nproc-per-node', str(self.ranks), '--max-restarts', str(self.restarts),
                '--monitor-interval', '0.2', *argv[1:]]  # argv[0] is this Python, which TORCHRUN runs

    @staticmethod
    def workers(agent):
        """The pids of the live workers of torchrun agent ``agent`` (a process), sorted."""
        return sorted(pid for pid in children(agent.pid) if '_replica.py' in cmdline(pid))


class Launch:
    """The same hook for a replica that is :func:`torchbearer_dist.launch` of ``ranks`` ranks (a replica group) with
    ``max_restarts=restarts``: tests/ft/_replica.py itself, ``--launch``."""

    links = ('lo', 'lo')

    def __init__(self, ranks=2, restarts=3):
        self.ranks, self.restarts = ranks, restarts

    def command(self, replica, argv):
        return [*argv, '--launch', str(self.ranks), '--max-restarts', str(self.restarts)]

    @staticmethod
    def workers(agent):
        """The pids of the live ranks of launcher ``agent``, sorted: its spawned children (not its resource tracker)."""
        return sorted(pid for pid in children(agent.pid) if 'spawn_main' in cmdline(pid))


def _done(replicas, i):
    """Every DONE line of replica ``i``'s ranks: ``[weights hash, heals, pid, metrics]`` each."""
    return [line.split(' ', 4)[1:] for line in replicas.out(i).splitlines() if line.startswith('DONE ')]


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
# A backstop only: the waits below end the test by its hard bound, moved by the four busy waits. stretch (HangGuard)
@pytest.mark.timeout(2 * HARD_TIMEOUT + 4 * (STRETCH - 1) * 2 * (STARTUP + LOAD_SLACK) + 30)
@pytest.mark.parametrize('hosts,kill_after,extra', [
    (Torchrun(1), 20, ()), (Torchrun(2), 15, ()), (Launch(2, 3), 15, ()),
    (Torchrun(2), 15, ('--local-steps', '4')),  # DiLoCo's meetings over the groups: the heal at a meeting's quorum
    # each group two GPUs on nccl (a rank each), the groups joined by torchft's gloo from device memory (issue 43,
    # item 3): gpu_session.sh runs it where a machine has two
    pytest.param(Launch(2, 3), 15, ('--backend', 'nccl', '--device', 'cuda'), marks=[
        pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')]),
], ids=['one-rank', 'group-of-two', 'group-of-two-under-launch', 'group-of-two-diloco', 'group-of-two-gpus-on-nccl'])
def test_a_worker_killed_under_torchrun_restarts_heals_live_and_ends_bit_identical(tmp_path, hosts, kill_after,
                                                                                    extra):
    # launch()'s spawned ranks import torch afresh beside a launcher that did too: in the whole tests/ft run (the
    # other worker's replicas beside them) its first steps took over 38 s in 2 runs of 2, so its starts wait twice
    # as long (measured 36 s for the whole test alone)
    slow = 2 if isinstance(hosts, Launch) else 1
    end = time.monotonic() + slow * HARD_TIMEOUT
    ranks = hosts.ranks

    def within(seconds):
        return max(1.0, min(seconds, end - time.monotonic()))

    def wait_busy(what, *i, allowed=slow * (STARTUP + LOAD_SLACK)):
        # a start (or training) that load slows, its processes busy past the wait, moves the hard bound with it
        nonlocal end
        began = time.monotonic()
        replicas.wait_for(what, allowed, starting=i)
        end += max(0.0, time.monotonic() - began - allowed)

    start, gate = str(tmp_path / 'start'), str(tmp_path / 'gate')
    workers = set()
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=hosts)
        try:
            # Replica 1 first, held after its first step until replica 0 is up: neither trains far alone (a
            # torchrun job starts its Pythons seconds apart under load), and replica 0 joins it at its next step.
            # Each of their ranks prints its own STEP and READY lines.
            restarted = replicas.start(1, *ARGS, *extra, '--gate', start, '--gate-step', '1')
            wait_busy(lambda: replicas.steps(restarted) >= ranks, restarted)
            survivor = replicas.start(0, *ARGS, *extra, '--gate', gate, '--gate-step', '40')  # held for the restart
            wait_busy(lambda: replicas.out(survivor).count('READY') == ranks, survivor)
            open(start, 'w').close()
            wait_busy(lambda: min(replicas.steps(survivor), replicas.steps(restarted)) >= ranks * kill_after,
                      survivor, restarted, allowed=STARTUP)
            first = {i: hosts.workers(replicas.process(i)) for i in (survivor, restarted)}
            workers |= {pid for pids in first.values() for pid in pids}
            assert [len(pids) for pids in first.values()] == [ranks, ranks], replicas.describe()

            os.kill(first[restarted][-1], signal.SIGKILL)  # a worker (a rank of the group), not torchrun's agent
            killed_at, before = time.monotonic(), replicas.steps(survivor)
            replicas.wait_for(lambda: replicas.steps(survivor) - before >= ranks * 3, within(LOST_BOUND + LOAD_SLACK))
            print('the survivor went on {:.1f} s after the kill'.format(time.monotonic() - killed_at))

            # torchrun's agent (or launch()) stops the group's other workers and starts new ones (its start gate
            # open): each heals from the same rank of the survivor, which waits at its step 40.
            wait_busy(lambda: replicas.out(restarted).count('READY') == 2 * ranks, restarted)
            second = hosts.workers(replicas.process(restarted))
            workers |= set(second)
            assert len(second) == ranks and not set(second) & set(first[restarted]), (second, replicas.describe())
            open(gate, 'w').close()
            replicas.wait_for(lambda: len(_done(replicas, survivor)) == ranks == len(_done(replicas, restarted)),
                              within(STARTUP + 60))
            codes = [replicas.process(i).wait(within(30)) for i in (survivor, restarted)]
            assert codes == [0, 0], replicas.describe()
        finally:
            _stop([process for process, _, _ in replicas.started], workers)
            replicas.kill_all()
    assert not [pid for sid in workers for pid in session(sid)], 'a worker outlived the test'
    assert not [pid for process, _, _ in replicas.started for pid in session(process.pid)], 'a rank outlived the test'

    done = {i: _done(replicas, i) for i in (survivor, restarted)}  # per rank: weights hash, heals, pid, metrics
    # The survivor's workers never restarted: one start each, and their DONE lines come from the first workers.
    assert replicas.out(survivor).count('READY') == ranks, replicas.describe()
    assert sorted(int(d[2]) for d in done[survivor]) == first[survivor], (done, first)
    # Replica 1 ended in the workers torchrun started after the kill, which healed from the survivor and took up
    # its position (fewer steps than a whole run, those before the kill left out).
    assert sorted(int(d[2]) for d in done[restarted]) == second and all(int(d[1]) >= 1 for d in done[restarted])
    steps = 120 // ranks  # a whole run's, per rank
    assert 'READY'.join(replicas.out(restarted).split('READY')[ranks + 1:]).count('STEP ') < ranks * (
        steps - kill_after), replicas.describe()
    # One event line per replica group (its rank 0's), not one per rank: each heal and dropped step named once.
    for i in (survivor, restarted):
        said = [line if ' healed ' in line else line.rsplit(':', 1)[0]  # a dropped step's cause: each rank's own
                for line in replicas.err(i).splitlines() if ' healed ' in line or ' dropped the ' in line]
        assert said and len(said) == len(set(said)), replicas.err(i)  # both heal: the survivor joined replica 1
    # Bit-identical weights on every rank of both replicas, and the same global metrics.
    every = done[survivor] + done[restarted]
    assert len({d[0] for d in every}) == 1, done
    assert len({d[3] for d in every}) == 1, done
    if isinstance(hosts, Launch):  # launch()'s one line for its restart, naming the killed rank (or its peer's error)
        lines = {i: [line for line in replicas.err(i).splitlines() if 'again (restart' in line]
                 for i in (survivor, restarted)}
        assert lines[survivor] == [] and len(lines[restarted]) == 1, replicas.describe()
        assert re.fullmatch(r'torchbearer_dist: rank [01] .*; starting the 2 ranks again \(restart 1 of 3\)',
                            lines[restarted][0]), lines


@pytest.mark.slow
@pytest.mark.timeout(3 * (STARTUP + LOAD_SLACK) + 60)
def test_a_restart_that_finds_nobody_to_heal_from_stops_instead_of_training_the_run_again_alone(tmp_path, monkeypatch):
    # Helper's netns run (lighthouse --min-replicas 1): a group restarted by torchrun 3 s after the other replica had
    # finished found nobody, trained the whole run again from its initial weights, alone, and saved its model over
    # the other's, both at exit 0. A restart (torchrun's count in its environment) that resumed a checkpoint goes on.
    checkpoint = str(tmp_path / 'r1.pt')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address)
        try:
            first = replicas.start(1, *ARGS, '--epochs', '1', '--checkpoint', checkpoint)  # its first run, alone
            assert replicas.process(first).wait(STARTUP + LOAD_SLACK + 30) == 0, replicas.describe()
            monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '1')
            again = replicas.start(1, *ARGS)
            assert replicas.process(again).wait(STARTUP + LOAD_SLACK + 30) == 1, replicas.describe()
            resumed = replicas.start(1, *ARGS, '--resume', checkpoint)
            assert replicas.process(resumed).wait(STARTUP + LOAD_SLACK + 30) == 0, replicas.describe()
        finally:
            replicas.kill_all()
    assert [line for line in replicas.err(again).splitlines() if line.startswith('error: ')] == [
        'error: this replica was started again (TORCHELASTIC_RESTART_COUNT=1) but finds no live replica to heal from: '
        'the others finished or were lost meanwhile; it stops rather than train the whole run again alone (start '
        'every replica anew for a new run, or resume from a checkpoint)'], replicas.describe()
    assert replicas.steps(again) == 0
    assert replicas.steps(resumed) == 60 and replicas.done(resumed), replicas.describe()  # epoch 2 of 2 only
