"""Replica groups of several ranks (issue 43, item 1): a machine's ranks, started by torchrun, are one replica.

Each of two replica groups is a ``torchrun --standalone --nproc-per-node 2 --max-restarts 2`` job of
tests/ft/_replica.py beside a real lighthouse: its two ranks share a process group (the fail-fast mode's, over
gloo), and each rank's torchft Manager averages with the same rank of the other group (a hierarchical all-reduce:
within the group, across the groups on the rank's half, back within the group). One rank of group 1 is killed
with SIGKILL mid-run: torchrun stops its other rank and starts the group again, whose two new ranks heal, each
from the same rank of group 0, and train the rest of the run beside it, while group 0's processes never restart.
All four ranks end bit-identical, with the same global metrics.
"""
import os
import signal
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, TORCHRUN, children, cmdline, session

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402
from test_torchrun_restarts import _stop  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: The lighthouse's heartbeat timeout (2 s) and a collective's timeout (10 s).
LOST_BOUND = 2 + 10
#: The test's own hard bound, seconds: two torchrun jobs of two ranks, a restart and 60 short steps.
HARD_TIMEOUT = 150
#: 1200 samples over 2 groups of 2 ranks at batch 10: 30 steps per epoch, 2 epochs.
ARGS = ('--replicas', '2', '--samples', '1200', '--epochs', '2', '--sleep', '0.05')


class Groups:
    """Where :class:`~_replicas.Replicas` runs group ``i``'s command: a torchrun job of two ranks, with restarts."""

    links = ('lo', 'lo')

    def __init__(self, restarts=2):
        self.restarts = restarts

    def command(self, replica, argv):
        return [*TORCHRUN, '--standalone', '--nproc-per-node', '2', '--max-restarts', str(self.restarts),
                '--monitor-interval', '0.2', *argv[1:]]


def _workers(agent):
    """The pids of the live workers of torchrun agent ``agent`` (a process)."""
    return sorted(pid for pid in children(agent.pid) if '_replica.py' in cmdline(pid))


def _done(replicas, i):
    """Every DONE line of group ``i``'s ranks: ``[weights hash, heals, pid, metrics]`` each."""
    return [line.split(' ', 4)[1:] for line in replicas.out(i).splitlines() if line.startswith('DONE ')]


@pytest.mark.slow
@pytest.mark.timeout(HARD_TIMEOUT + 30)  # a backstop only: the waits below end the test by HARD_TIMEOUT
def test_a_rank_killed_restarts_its_group_which_heals_from_the_other_group_and_all_four_end_bit_identical(tmp_path):
    end = time.monotonic() + HARD_TIMEOUT

    def within(seconds):
        return max(1.0, min(seconds, end - time.monotonic()))

    start, gate = str(tmp_path / 'start'), str(tmp_path / 'gate')
    workers = set()
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Groups())
        try:
            # Group 1 first, held after its first step until group 0 is up; group 0 holds at its 40th step (of 60)
            # until group 1 is back after the kill.
            lost = replicas.start(1, *ARGS, '--gate', start, '--gate-step', '1')
            replicas.wait_for(lambda: replicas.steps(lost) >= 2, within(STARTUP + LOAD_SLACK))
            survivor = replicas.start(0, *ARGS, '--gate', gate, '--gate-step', '40')
            replicas.wait_for(lambda: replicas.out(survivor).count('READY') == 2, within(STARTUP + LOAD_SLACK))
            open(start, 'w').close()
            replicas.wait_for(lambda: min(replicas.steps(survivor), replicas.steps(lost)) >= 2 * 15, within(STARTUP))
            first = {i: _workers(replicas.process(i)) for i in (survivor, lost)}
            workers |= {pid for pids in first.values() for pid in pids}
            assert [len(pids) for pids in first.values()] == [2, 2], replicas.describe()

            os.kill(first[lost][1], signal.SIGKILL)  # one rank of group 1, not torchrun's agent
            killed_at, before = time.monotonic(), replicas.steps(survivor)
            replicas.wait_for(lambda: replicas.steps(survivor) - before >= 2 * 3, within(LOST_BOUND + LOAD_SLACK))
            print('group 0 went on {:.1f} s after the kill'.format(time.monotonic() - killed_at))

            # torchrun stops group 1's other rank and starts two new ones, which heal from group 0.
            replicas.wait_for(lambda: replicas.out(lost).count('READY') == 4, within(STARTUP + LOAD_SLACK))
            second = _workers(replicas.process(lost))
            workers |= set(second)
            assert len(second) == 2 and not set(second) & set(first[lost]), (second, first, replicas.describe())
            open(gate, 'w').close()
            replicas.wait_for(lambda: len(_done(replicas, survivor)) == 2 and len(_done(replicas, lost)) == 2,
                              within(STARTUP + 60))
            codes = [replicas.process(i).wait(within(30)) for i in (survivor, lost)]
            assert codes == [0, 0], replicas.describe()
        finally:
            _stop([process for process, _, _ in replicas.started], workers)
            replicas.kill_all()
    assert not [pid for sid in workers for pid in session(sid)], 'a worker outlived the test'

    done = {i: _done(replicas, i) for i in (survivor, lost)}  # per rank: weights hash, heals, pid, metrics
    # Group 0's ranks never restarted: one start each, and their DONE lines come from the first workers.
    assert replicas.out(survivor).count('READY') == 2, replicas.describe()
    assert sorted(int(d[2]) for d in done[survivor]) == first[survivor], (done, first)
    # Group 1 ended in the workers torchrun started after the kill, both healed from group 0.
    assert sorted(int(d[2]) for d in done[lost]) == second and all(int(d[1]) >= 1 for d in done[lost]), done
    # Bit-identical weights on all four ranks, and the same global metrics.
    ranks = done[survivor] + done[lost]
    assert len({d[0] for d in ranks}) == 1, done
    assert len({d[3] for d in ranks}) == 1, done


@pytest.mark.slow
@pytest.mark.timeout(STARTUP + LOAD_SLACK + 60)
def test_diloco_with_a_replica_group_of_two_ranks_stops_each_rank_in_one_line_before_any_quorum(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Groups(restarts=0))
        try:
            group = replicas.start(0, *ARGS, '--local-steps', '4')
            assert replicas.process(group).wait(STARTUP + LOAD_SLACK + 30) != 0, replicas.describe()
        finally:
            replicas.kill_all()
    lines = sorted(line for line in replicas.err(group).splitlines() if line.startswith('error: '))
    assert lines == ["error: the fault-tolerant mode's DiLoCo meetings run one process per replica group, but this "
                     'process is rank {} of a group of 2; start each replica alone, or average at every step (no '
                     'local_steps)'.format(rank) for rank in (0, 1)], replicas.describe()
    assert 'READY' not in replicas.out(group)  # no Manager, no quorum
