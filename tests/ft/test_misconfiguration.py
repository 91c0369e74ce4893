"""A replica started with another configuration than the replicas training is refused in one line, on it alone.

Real replica processes (tests/ft/_replica.py) on loopback, a torchft lighthouse in this process. The healthy
replica trains 3 epochs of 60 steps (held at its 30th until the other asks for its first quorum); the
misconfigured one starts once it trains, heals at its first quorum, and is refused there (before, it trained
on: another shard count stalled every epoch end a full timeout and ended in different models at exit 0; a
second live replica of one name counted its shard twice).
"""
import re
import time

import pytest

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

HEALTHY = ('--epochs', '3', '--samples', '1200', '--sleep', '0.1', '--timeout', '5')


def gated(replicas):
    """Options that hold a healthy replica at its 30th step until :func:`release` (it would otherwise finish its
    180 steps on a loaded machine before the misconfigured one has started, which then trains alone)."""
    return ('--gate', str(replicas.tmp_path / 'gate'), '--gate-step', '30')


def release(replicas, joiner):
    """Once ``joiner`` asks for its first quorum (READY), let the healthy replicas go on into it."""
    replicas.wait_for(lambda: 'READY' in replicas.out(joiner), STARTUP + 60)
    (replicas.tmp_path / 'gate').touch()
    return time.monotonic()


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
    (0, ('--replicas', '2'), "error: this replica cannot join: its replica_id 'r0' is the name of another live "
                             'replica, which trains; stop the other process of that name (a requeue while the old job '
                             'still runs?) or pass another replica_id'),
], ids=['shards', 'batch-size', 'local-steps', 'replica-id'])
def test_a_misconfigured_replica_is_refused_in_one_line_and_the_training_one_goes_on(replicas, replica, theirs, line):
    healthy = replicas.start(0, '--replicas', '2', *HEALTHY, *gated(replicas))
    replicas.wait_for(lambda: replicas.steps(healthy) >= 10, STARTUP + 60)
    other = replicas.start(replica, *theirs, *HEALTHY)
    ready = release(replicas, other)
    assert replicas.process(other).wait(10 + LOAD_SLACK) == 1, replicas.describe()
    assert time.monotonic() - ready < 10 + LOAD_SLACK  # named within 10 s of its first quorum
    assert replicas.err(other).strip().splitlines()[-1] == line, replicas.describe()
    assert replicas.steps(other) == 0, replicas.describe()  # it trained nothing
    # The training replica goes on to the end of its run, alone again, and is never the one refused.
    replicas.wait_for(lambda: replicas.done(healthy), STARTUP + 120)
    assert replicas.process(healthy).wait(30) == 0, replicas.describe()
    assert replicas.steps(healthy) == 180


@pytest.mark.timeout(240)
def test_a_replica_that_heals_past_the_end_of_its_own_run_is_refused_in_one_line(replicas):
    # A replica of one epoch joins one of three in its second epoch: it heals there, with nothing of its own run left
    # to train. Before, it ended its run at once inside the other's quorum, and its end-of-run exchanges met the
    # other's gradients (gloo: "Received data size doesn't match expected size"): it aborted without a line.
    gate = ('--gate', str(replicas.tmp_path / 'gate'), '--gate-step', '70')  # held at epoch 1, batch 10
    healthy = replicas.start(0, '--replicas', '2', *HEALTHY, *gate)
    replicas.wait_for(lambda: replicas.steps(healthy) >= 70, STARTUP + 60)  # held there
    other = replicas.start(1, '--replicas', '2', *HEALTHY, '--epochs', '1')
    release(replicas, other)
    assert replicas.process(other).wait(10 + LOAD_SLACK) == 1, replicas.describe()
    assert re.fullmatch(r'error: this replica healed at epoch 1, batch \d+, past the end of its own run of 1 epoch: '
                        r'the replica it healed from trains more epochs and goes on; start every replica with the '
                        r'same number of epochs', replicas.err(other).strip().splitlines()[-1]), replicas.describe()
    assert replicas.steps(other) == 0, replicas.describe()
    replicas.wait_for(lambda: replicas.done(healthy), STARTUP + 120)
    assert replicas.process(healthy).wait(30) == 0, replicas.describe()
    assert replicas.steps(healthy) == 180


@pytest.mark.timeout(240)
def test_a_second_replica_of_a_taken_name_is_refused_whichever_replica_it_heals_from(replicas):
    # r0 and r1 train; a second r1 starts and heals from either (today's payload check saw only a healer of its
    # name): the vote at its first quorum sees two rows of one name, and refuses the one that has not trained.
    first = [replicas.start(r, '--replicas', '2', *HEALTHY, *gated(replicas)) for r in range(2)]
    replicas.wait_for(lambda: min(replicas.steps(i) for i in first) >= 10, STARTUP + 60)
    twin = replicas.start(1, '--replicas', '2', *HEALTHY)
    release(replicas, twin)
    assert replicas.process(twin).wait(10 + LOAD_SLACK) == 1, replicas.describe()
    assert replicas.err(twin).strip().splitlines()[-1] == (
        "error: this replica cannot join: its replica_id 'r1' is the name of another live replica, which trains; stop "
        'the other process of that name (a requeue while the old job still runs?) or pass another replica_id')
    assert replicas.steps(twin) == 0, replicas.describe()
    replicas.wait_for(lambda: all(replicas.done(i) for i in first), STARTUP + 120)
    assert [replicas.process(i).wait(30) for i in first] == [0, 0], replicas.describe()
    assert [replicas.position(i) for i in first] == [180, 180], replicas.describe()  # to the run's last step
    assert replicas.done(first[0])[0] == replicas.done(first[1])[0]  # one model: the twin never trained in it
    for i in first:  # each said, in one line, that the quorum went on without the refused one
        assert 'goes on without rank' in replicas.err(i), replicas.describe()


@pytest.mark.timeout(300)
@pytest.mark.parametrize('odd', [0, 2], ids=['first-name', 'last-name'])
def test_a_replica_of_another_model_starting_with_the_others_is_the_one_refused(tmp_path, odd):
    # Three replicas start together (a lighthouse of min_replicas=3): the one with another model is refused,
    # whether or not it is the source of torchft's first-step synchronisation (which the others used to heal
    # from, and were refused by). It is restarted with the right model, and the three train one model.
    from _replicas import Replicas

    from torchbearer_dist.ft import Lighthouse
    args = ('--replicas', '3', '--epochs', '1', '--samples', '1800', '--timeout', '10')
    with Lighthouse(bind='127.0.0.1:0', min_replicas=3, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            started = [replicas.start(r, *args, *(('--hidden', '16') if r == odd else ())) for r in range(3)]
            assert replicas.process(started[odd]).wait(STARTUP + 30 + LOAD_SLACK) == 1, replicas.describe()
            assert replicas.err(started[odd]).strip().splitlines()[-1] == (
                "error: this replica cannot join: its model (the names, shapes and dtypes of the modules' tensors) "
                'differs from those at 2 of the 3 replicas starting; start every replica with the same model')
            assert replicas.steps(started[odd]) == 0
            again = replicas.start(odd, *args)  # the user mends it; the others wait for a third replica meanwhile
            good = [i for r, i in enumerate(started) if r != odd] + [again]
            replicas.wait_for(lambda: all(replicas.done(i) for i in good), STARTUP + 120)
            assert [replicas.process(i).wait(30) for i in good] == [0, 0, 0], replicas.describe()
            assert len({replicas.done(i)[0] for i in good}) == 1, replicas.describe()  # bit-identical weights
            assert [replicas.steps(i) for i in good] == [60, 60, 60]
        finally:
            replicas.kill_all()
