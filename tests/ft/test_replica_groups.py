"""Replica groups of several ranks (issue 43): a machine's ranks, started by torchrun, are one replica.

A group's rank killed, its group restarted by torchrun and healed rank by rank from the other group, all ranks
bit-identical: ``test_torchrun_restarts.py`` (``group-of-two``). The hierarchical all-reduce's arithmetic:
``tests/sync/test_group.py``. Here, what a group refuses.
"""
import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402
from test_torchrun_restarts import ARGS, Torchrun  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)


@pytest.mark.slow
@pytest.mark.timeout(STARTUP + LOAD_SLACK + 60)
def test_diloco_with_a_replica_group_of_two_ranks_stops_each_rank_in_one_line_before_any_quorum(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=Torchrun(ranks=2, restarts=0))
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
