"""A stop set by a callback on one replica ends every live replica after the same step (issue 43, item 2).

Before, the fault-tolerant mode had no stop agreement: a callback that stopped one replica (a time budget,
TerminateOnNaN) ended that replica's run alone, the others trained on, and every process ended at exit 0 with
different weights (tried: replica 0 stopped at epoch 0, batch 20; replica 1 trained its 120 steps). Now the request
rides in the gradient buckets' stop slot of the next step, over the live replicas (and every rank of their groups),
and counts once torchft commits that step; DiLoCo's meetings agree on it at the end of the pass.

Real replicas of tests/ft/_replica.py beside a real lighthouse; ``--stop-at EPOCH BATCH`` is that user's callback,
on rank 0 of replica 0 only.
"""
import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replicas import Replicas  # noqa: E402
from test_torchrun_restarts import Torchrun  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: 1200 samples over 2 replicas at batch 10: 60 steps an epoch (30 in groups of two ranks), 2 epochs.
ARGS = ('--replicas', '2', '--samples', '1200', '--epochs', '2')


def _lines(replicas, i, word):
    return [line.split() for line in replicas.out(i).splitlines() if line.startswith(word + ' ')]


def _run(tmp_path, ranks, *extra):
    """Two replicas (replica groups of ``ranks``) in one quorum from the first step, replica 0's rank 0 stopping at
    epoch 1, batch 5; returns ``(replicas, their indices)`` once both ended."""
    hosts = Torchrun(ranks=ranks, restarts=0) if ranks > 1 else None
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=15.0) as lighthouse:
        replicas = Replicas(tmp_path, lighthouse.address, hosts=hosts)
        try:
            started = [replicas.start(0, *ARGS, '--min-replicas', '2', '--stop-at', '1', '5', *extra),
                       replicas.start(1, *ARGS, '--min-replicas', '2', *extra)]
            codes = [replicas.process(i).wait(2 * (STARTUP + LOAD_SLACK) + 60) for i in started]
            assert codes == [0, 0], replicas.describe()
        finally:
            replicas.kill_all()
    return replicas, started


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 90)
@pytest.mark.parametrize('ranks', [1, 2], ids=['one-rank', 'group-of-two'])
def test_a_stop_on_one_replica_stops_every_replica_after_the_same_step_with_the_same_weights(tmp_path, ranks):
    replicas, started = _run(tmp_path, ranks)
    assert _lines(replicas, started[0], 'STOP') == [['STOP', 'asked', 'at', '1', '5']], replicas.describe()
    # The request of epoch 1's batch 5 rides with batch 6: every rank of both replicas trains it, then stops.
    per_epoch = 60 // ranks
    for i in started:
        steps = _lines(replicas, i, 'STEP')
        assert len(steps) == ranks * (per_epoch + 7), replicas.describe()
        assert steps[-1][1:3] == ['1', '6'], replicas.describe()
    done = [d for i in started for d in _lines(replicas, i, 'DONE')]
    assert len(done) == 2 * ranks and len({d[1] for d in done}) == 1, done
    assert not [line for i in started for line in replicas.err(i).splitlines() if line.startswith('error')]


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 90)
def test_a_stop_on_one_replica_under_diloco_meetings_stops_every_replica_at_the_end_of_the_pass(tmp_path):
    # No stop flag travels at each step through torchft's meetings: the request is agreed at the pass's end, where
    # the last meeting then brings every replica's progress into one model.
    replicas, started = _run(tmp_path, 1, '--local-steps', '4', '--epochs', '3')  # would go on to a third pass
    for i in started:
        steps = _lines(replicas, i, 'STEP')
        assert len(steps) == 120 and steps[-1][1:3] == ['1', '59'], replicas.describe()
    # torchbearer records no epoch that a stop ended before its validation: epoch 0's only, on both
    assert [line.split()[1:3] for i in started for line in replicas.out(i).splitlines()
            if line.startswith('EPOCHS ')] == [['1', 'RESTARTS']] * 2, replicas.describe()
    done = [d for i in started for d in _lines(replicas, i, 'DONE')]
    assert len(done) == 2 and len({d[1] for d in done}) == 1, done
