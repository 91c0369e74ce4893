"""Replica groups of several ranks (issue 43): a machine's ranks, started by torchrun, are one replica.

A group's rank killed, its group restarted by torchrun and healed rank by rank from the other group, all ranks
bit-identical: ``test_torchrun_restarts.py`` (``group-of-two``). The hierarchical all-reduce's arithmetic:
``tests/sync/test_group.py``. Here, DiLoCo's meetings over groups, a group's rank 0 lost, and two groups that start
together.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from _dist import LOAD_SLACK, STARTUP, child_env, free_port, kill_session, python

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402
from test_torchrun_restarts import ARGS, Torchrun  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

REPLICA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_replica.py')


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 90)
def test_diloco_meetings_of_two_groups_of_two_ranks_average_every_rank_and_end_bit_identical(tmp_path):
    # DiLoCo over replica groups: each rank trains its own shard alone between meetings (the fail-fast mode's DiLoCo
    # over the 4 ranks); a meeting sums within the group, sends each rank's half across the groups, and sums back
    # (HierarchicalGroup). Before, a group stopped each rank: "DiLoCo meetings run one process per replica group".
    # With the meeting over the quorum alone (no sum within the group), each group's two ranks end apart.
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=15.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Torchrun(ranks=2, restarts=0))
        try:
            started = [replicas.start(r, *ARGS, '--min-replicas', '2', '--local-steps', '4') for r in (0, 1)]
            codes = [replicas.process(i).wait(2 * (STARTUP + LOAD_SLACK) + 60) for i in started]
            assert codes == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    done = [line.split(' ', 4)[1:] for i in started for line in replicas.out(i).splitlines() if
            line.startswith('DONE ')]
    assert len(done) == 4 and len({d[0] for d in done}) == 1 and len({d[3] for d in done}) == 1, done
    assert not [line for i in started for line in replicas.err(i).splitlines() if line.startswith('error')]


def _by_hand(tmp_path, lighthouse, port):
    """A replica group of two ranks started by hand (torchrun's environment, no launcher to stop them): its
    processes and their output files."""
    started = []
    for rank in range(2):
        env = child_env(RUST_LOG='warn', RANK=str(rank), WORLD_SIZE='2', LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE='2',
                        MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        out = tmp_path / 'rank{}.out'.format(rank)
        with open(out, 'w') as stream:
            started.append((subprocess.Popen(python(REPLICA, '--lighthouse', lighthouse, '--replica', '0',
                                                    '--replicas', '1', *ARGS[2:]), stdout=stream,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True), out))
    return started


@pytest.mark.slow
@pytest.mark.timeout(STARTUP + LOAD_SLACK + 90)
def test_a_groups_rank_0_lost_is_named_by_its_other_rank_which_stops(tmp_path):
    # Rank 0 holds the group's store and torchft server; the other rank's quorum and commit go through it. Before,
    # it said "no quorum ... fewer live replicas than the minimum" or torchft's "transport error".
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1) as lighthouse:
        started = _by_hand(tmp_path, lighthouse.address, free_port())
        try:
            end = time.monotonic() + STARTUP + LOAD_SLACK
            while started[0][1].read_text().count('STEP ') < 10 and time.monotonic() < end:
                time.sleep(0.1)
            os.kill(started[0][0].pid, signal.SIGKILL)
            killed = time.monotonic()
            code = started[1][0].wait(60)
            print('rank 1 stopped {:.1f} s after rank 0 was killed'.format(time.monotonic() - killed))
        finally:
            for process, _ in started:
                kill_session(process.pid)
                process.wait()
    text = started[1][1].read_text()
    lines = [line for line in text.splitlines() if line.startswith('error: ')]
    assert code == 1 and len(lines) == 1, text[-3000:]
    # where the quorum or the commit found it: the group's line; inside the group's own all-reduce: the fail-fast
    # mode's, naming rank 0 as well
    assert lines[0] in ('error: rank 0 of replica group r0, which holds its store and torchft server, is gone: rank 1 '
                        'stops with its group (its launcher starts the group again, and it heals from the live '
                        'replicas)', ) or re.match(r'error: rank 0 .*\(rank 1 stopped\)$', lines[0]), lines
    assert 'DONE' not in text


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 90)
def test_two_groups_in_the_first_quorum_start_from_one_replicas_weights_and_end_bit_identical(tmp_path):
    # Both groups in the first quorum (min_replicas=2), each rank of each replica with its own initial weights:
    # torchft's first-step sync gives rank i the weights of the quorum's replica i, so rank 0 and rank 1 of every
    # group held different models to the end (the SLURM test, helper); every rank now holds one model.
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=15.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Torchrun(ranks=2, restarts=0))
        try:
            started = [replicas.start(r, *ARGS, '--min-replicas', '2') for r in (0, 1)]
            codes = [replicas.process(i).wait(2 * (STARTUP + LOAD_SLACK) + 60) for i in started]
            assert codes == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    done = [line.split(' ', 4)[1:] for i in started for line in replicas.out(i).splitlines() if
            line.startswith('DONE ')]
    assert len(done) == 4 and len({d[0] for d in done}) == 1 and len({d[3] for d in done}) == 1, done
