"""A replica requeued by SLURM rejoins live (issue 33, item 3): the fault-tolerant mode under ``sbatch --requeue``.

On a real one-node cluster (tests/_slurm.py), each of two replicas of tests/ft/_replica.py is a batch job of
its own, ``sbatch --requeue``, beside a real lighthouse; both need each other at every step (``min_replicas=2``).
Mid-run ``scontrol requeue`` ends the job of replica 1 and puts it back in the queue, as SLURM does when it
replaces a machine; it runs again with the same replica id, heals from replica 0 and trains the rest of the run
beside it, while replica 0's process waits and never restarts; both end bit-identical.

With ``sbatch --ntasks 2`` each replica is a replica group of two ranks: its batch script runs two tasks of
_replica.py, whose process group is the srun step's (SLURM_PROCID, SLURM_NTASKS). The requeue ends both ranks of
replica 1; the job's next run starts two new ranks, each of which heals from the same rank of replica 0, whose ranks
never restart; all four ranks end bit-identical, with the same metrics.
"""
import math
import os
import shlex
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, python
from _slurm import REQUIRES, START_SECONDS, one_node

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

pytestmark = REQUIRES

REPLICA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_replica.py')
#: The test's own hard bound once the cluster is up, seconds: two jobs, a requeue and 120 short steps take
#: about 40 s idle; :data:`RANK_SLACK` more for each further rank of a group (groups of two: 60 s at a load of 5,
#: 110 s at a load of 9, the ranks of a job starting at once on the machine's 2 cores).
HARD_TIMEOUT = 120
RANK_SLACK = 60
#: 1200 samples over 2 replicas at batch 10: 60 steps per epoch (30 in groups of two), 2 epochs. Both replicas in
#: every step; while replica 1 is requeued, replica 0 waits for it at its quorum, up to 3 x --timeout (60 s).
ARGS = ('--replicas', '2', '--samples', '1200', '--epochs', '2', '--sleep', '0.05', '--min-replicas', '2',
        '--timeout', '20')


class Job:
    """Replica ``replica`` as a batch job that SLURM may requeue; every run's output appended to one file, each
    run's process opening with ``START <pid> <SLURM_RESTART_COUNT>`` (the shell ``exec``\\ s the replica: the same
    pid). With ``ranks`` > 1 a replica group: ``--ntasks ranks``, the batch script ``srun``\\ s that shell once per
    task, each of the group's ranks printing its own START, STEP, READY and DONE lines."""

    def __init__(self, cluster, tmp_path, replica, lighthouse, ranks=1):
        self.cluster, self.replica, self.state = cluster, replica, {}
        self.out, self.err = (tmp_path / 'r{}.{}'.format(replica, kind) for kind in ('out', 'err'))
        command = 'echo START $$ ${SLURM_RESTART_COUNT:-0}; exec ' + shlex.join(
            python(REPLICA, '--lighthouse', lighthouse, '--replica', str(replica), *ARGS))
        group, export = (), 'ALL,RUST_LOG=warn'
        if ranks > 1:  # each job's group meets on its job id's port (on one node both once met on 29500)
            group, command = ('--ntasks', str(ranks)), 'exec srun bash -c ' + shlex.quote(command)
        submitted = cluster.run('sbatch', '--parsable', '--requeue', *group, '--open-mode=append',
                                '--export=' + export, '--job-name',
                                'r{}'.format(replica), '--chdir', str(tmp_path), '-o', str(self.out), '-e',
                                str(self.err), '--wrap', command)
        assert submitted.returncode == 0, submitted.stderr
        self.id = submitted.stdout.strip().split(';')[0]

    def text(self):
        return self.out.read_text() if self.out.exists() else ''

    def starts(self):
        """``[(pid, restart count)]`` of each run of the job so far."""
        return [tuple(int(v) for v in line.split()[1:3]) for line in self.text().splitlines()
                if line.startswith('START ')]

    def steps(self):
        return self.text().count('STEP ')

    def done(self):
        """Every DONE line of the job's ranks, of all its runs: ``[weights hash, heals, pid, metrics]`` each."""
        return [line.split(' ', 4)[1:] for line in self.text().splitlines() if line.startswith('DONE ')]

    def show(self):
        """SLURM's fields of the job (``scontrol show job``), e.g. ``JobState``, ``Reason``, ``Restarts``."""
        fields = self.cluster.run('scontrol', '-o', 'show', 'job', self.id).stdout.split()
        self.state = dict(field.split('=', 1) for field in fields if '=' in field)
        return self.state

    def describe(self):
        """Its output and the fields SLURM showed last (asking no more: the cluster may be gone)."""
        err = self.err.read_text() if self.err.exists() else ''
        return '--- replica {} (job {}: {}):\n{}\n{}'.format(
            self.replica, self.id, {k: v for k, v in self.state.items() if k in ('JobState', 'Reason', 'Restarts')},
            self.text()[-800:], err[-1500:])


def _alive(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.timeout(START_SECONDS + HARD_TIMEOUT + RANK_SLACK + 60)  # a backstop only: the cluster's start and the
# waits below
@pytest.mark.parametrize('ranks,requeue_after', [(1, 20), (2, 15)], ids=['one-rank', 'group-of-two'])
def test_a_requeued_replica_heals_live_and_ends_bit_identical(tmp_path, ranks, requeue_after):
    jobs = []

    def describe():
        return '\n'.join(job.describe() for job in jobs) + '\n' + cluster.log_tail()

    def wait_for(what, seconds):
        seconds = max(1.0, min(seconds, end - time.monotonic()))
        deadline = time.monotonic() + seconds
        while not what():
            if time.monotonic() > deadline:
                for job in jobs:
                    job.show()
                raise AssertionError('still waiting after {:.0f} s:\n{}'.format(seconds, describe()))
            time.sleep(0.2)

    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=20.0, heartbeat_timeout=2.0) as lighthouse, \
            one_node(tmp_path) as cluster:
        end = time.monotonic() + HARD_TIMEOUT + RANK_SLACK * (ranks - 1)
        survivor, requeued = (Job(cluster, tmp_path, i, lighthouse.address, ranks) for i in (0, 1))
        jobs += [survivor, requeued]
        wait_for(lambda: min(survivor.steps(), requeued.steps()) >= ranks * requeue_after, 2 * STARTUP + LOAD_SLACK)
        # Both jobs run at once on the node (OverSubscribe=FORCE), each rank started once.
        assert [len(job.starts()) for job in jobs] == [ranks, ranks], describe()
        first = sorted(pid for pid, _ in requeued.starts())

        result = cluster.run('scontrol', 'requeue', requeued.id)
        assert result.returncode == 0, result.stderr
        # Steps alone count from the requeued process's end: SLURM's SIGTERM reaches it some steps after scontrol
        # returns (3 steps on a loaded machine), steps replica 1 still took part in.
        wait_for(lambda: not any(_alive(pid) for pid in first), 30)
        before = survivor.steps()
        # SLURM ends the job's processes (SIGTERM) and, once the job has left the node, puts it back in the queue,
        # held until now + 120 s (AuthInfo's cred_expire): PENDING, Reason=BeginTime. On SLURM 22.05 the begin time
        # is moved with scontrol update ... StartTime=now (``begintime=now`` is refused: "Update of this parameter
        # is not supported"; ``scontrol release`` leaves the begin time, the job stays held). Not in the second of
        # the requeue: slurmd revoked the job's credential then, and refuses one created in the same second ("Job N
        # already killed, do not launch batch job": the job ends FAILED), which the 120 s hold is there to avoid.
        wait_for(lambda: requeued.show().get('JobState') == 'PENDING', 30)
        assert requeued.show().get('Reason') == 'BeginTime', describe()
        time.sleep(max(0.0, math.floor(time.time()) + 1.1 - time.time()))
        result = cluster.run('scontrol', 'update', 'jobid={}'.format(requeued.id), 'StartTime=now')
        assert result.returncode == 0, result.stderr

        # It runs again: a new process of replica 1 (restart count 1) per rank, which heals from replica 0's rank.
        # A group's ranks start at once (25 s to 37 s and more for two at a load of 8).
        wait_for(lambda: requeued.text().count('READY') == 2 * ranks, ranks * STARTUP + LOAD_SLACK)
        alone = survivor.steps() - before
        wait_for(lambda: len(survivor.done()) == ranks == len(requeued.done()), STARTUP + 60)
        wait_for(lambda: all(job.show().get('JobState') == 'COMPLETED' for job in jobs), 30)
        states = [job.show() for job in jobs]
    assert not cluster.leftovers, 'processes of the cluster outlived its daemons: {}'.format(cluster.leftovers)

    assert [state.get('ExitCode') for state in states] == ['0:0', '0:0'], describe()
    assert [state.get('Restarts') for state in states] == ['0', '1'], describe()
    done = {job.replica: job.done() for job in jobs}  # per rank: weights hash, heals, pid, metrics
    assert [len(done[0]), len(done[1])] == [ranks, ranks], describe()
    pids = {i: sorted(int(d[2]) for d in done[i]) for i in done}
    steps = 120 // ranks  # a whole run's, per rank
    # Replica 0's processes never restarted: one start each, and their DONE lines from them. They waited for
    # replica 1 at their quorum, no step alone (min_replicas=2): per rank, the step under way when replica 1 died,
    # the next ones whose quorum formed before the lighthouse missed its heartbeat, and what the 0.2 s poll of its
    # death let by (3 seen under load), against the dozens of steps of the seconds replica 1 was down.
    assert sorted(survivor.starts()) == [(pid, 0) for pid in pids[0]], describe()
    assert survivor.text().count('READY') == ranks, describe()
    assert survivor.steps() == ranks * steps and alone <= 4 * ranks, (alone, describe())
    # Replica 1 ended in the processes of its second run, which healed, each rank from replica 0's, and took up its
    # position (not a whole run: the steps before the requeue left out).
    starts = requeued.starts()
    assert len(starts) == 2 * ranks and sorted(starts[:ranks]) == [(pid, 0) for pid in first], describe()
    assert sorted(starts[ranks:]) == [(pid, 1) for pid in pids[1]] and not set(first) & set(pids[1]), describe()
    assert all(int(d[1]) >= 1 for d in done[1]), 'the requeued replica did not heal: {}'.format(describe())
    assert 'READY'.join(requeued.text().split('READY')[ranks + 1:]).count('STEP ') <= ranks * (
        steps - requeue_after), describe()
    # Bit-identical weights on every rank of both replicas, and the same global metrics.
    every = done[0] + done[1]
    assert len({d[0] for d in every}) == 1, done
    assert len({d[3] for d in every}) == 1, done
