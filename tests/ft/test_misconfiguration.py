"""A replica started with another configuration than the replicas training is refused in one line, on it alone.

Real replica processes (tests/ft/_replica.py) on loopback, a torchft lighthouse in this process. The healthy
replica trains 3 epochs of 60 steps; the misconfigured one starts once it trains, heals at its first quorum,
and is refused there (before, it trained on: another shard count stalled every epoch end a full timeout and
ended in different models at exit 0; a second live replica of one name counted its shard twice).
"""
import time

import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

HEALTHY = ('--epochs', '3', '--samples', '1200', '--sleep', '0.1', '--timeout', '5')


@pytest.mark.timeout(240)
@pytest.mark.parametrize('replica, theirs, line', [
    (1, ('--replicas', '3'), "error: this replica cannot join: its shard count (the DistributedSampler's num_replicas, "
                             "the example's --replicas) is 3 here and 2 at the replicas training; start every replica "
                             'with the same shard count'),
    (1, ('--replicas', '2', '--batch-size', '20'), 'error: this replica cannot join: its batch size is 20 here and 10 '
                                                   'at the replicas training; start every replica with the same batch '
                                                   'size'),
    (1, ('--replicas', '2', '--local-steps', '8'), "error: this replica cannot join: its local_steps (DiLoCo's; None: "
                                                   'averaging at every step) is 8 here and None at the replicas '
                                                   'training; start every replica with the same local_steps'),
    (0, ('--replicas', '2'), "error: this replica cannot join: its replica_id 'r0' is the name of the live replica it "
                             'would heal from; stop the other process of that name (a requeue while the old job still '
                             'runs?) or pass another replica_id'),
], ids=['shards', 'batch-size', 'local-steps', 'replica-id'])
def test_a_misconfigured_replica_is_refused_in_one_line_and_the_training_one_goes_on(replicas, replica, theirs, line):
    healthy = replicas.start(0, '--replicas', '2', *HEALTHY)
    replicas.wait_for(lambda: replicas.steps(healthy) >= 10, STARTUP + 60)
    other = replicas.start(replica, *theirs, *HEALTHY)
    replicas.wait_for(lambda: 'READY' in replicas.out(other), STARTUP + 60)
    ready = time.monotonic()
    assert replicas.process(other).wait(10 + LOAD_SLACK) == 1, replicas.describe()
    assert time.monotonic() - ready < 10 + LOAD_SLACK  # named within 10 s of its first quorum
    assert replicas.err(other).strip().splitlines()[-1] == line, replicas.describe()
    assert replicas.steps(other) == 0, replicas.describe()  # it trained nothing
    # The training replica goes on to the end of its run, alone again, and is never the one refused.
    replicas.wait_for(lambda: replicas.done(healthy), STARTUP + 120)
    assert replicas.process(healthy).wait(30) == 0, replicas.describe()
    assert replicas.steps(healthy) == 180
