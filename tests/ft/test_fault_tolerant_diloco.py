"""DiLoCo in the fault-tolerant mode: its meetings through torchft's Manager, real replicas and a real lighthouse.

``distributed_callbacks(fault_tolerant=..., local_steps=H)``: no quorum nor averaging at each step; every
H steps a blocking fp32 meeting over a quorum of the live replicas, where a (re)started one heals.
"""
import pytest
import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler

import torchbearer_dist as tbd

from _dist import LOAD_SLACK, STARTUP, run_workers

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replica import ClipGradients, Record, dataset, model  # noqa: E402
from _replicas import Replicas, kill_one_and_heal, late_joiner, train_together  # noqa: E402

from torchbearer_dist.ft import Lighthouse  # noqa: E402 (after the skip)

#: 6 steps an epoch on each of 2 replicas: meetings after steps 4, 8, 12, 16, and at the run's end (18).
H, SAMPLES, EPOCHS = 4, 120, 3
#: As in test_fault_tolerant: the lighthouse's heartbeat timeout (2 s) and a collective's timeout (10 s).
LOST_BOUND = 2 + 10


def _worker_fail_fast():
    """The same Trial as tests/ft/_replica.py's, in the fail-fast mode's DiLoCo, blocking and uncompressed."""
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    data = dataset(SAMPLES)
    loader = DataLoader(data, batch_size=10, sampler=DistributedSampler(data, num_replicas=2, rank=rank, seed=0))
    net = model(rank, 32)  # BroadcastParameters gives every rank rank 0's weights, as init_sync gives replica 0's
    callbacks = tbd.distributed_callbacks(local_steps=H, compression=None, overlap_steps=0, report=False)
    trial = torchbearer.Trial(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                              torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                              callbacks=[ClipGradients(0.25), *callbacks, Record()])
    history = trial.with_generators(loader).run(EPOCHS, verbose=0)
    diloco = next(c for c in callbacks if isinstance(c, tbd.DiLoCo))
    return {'final': net.state_dict(), 'history': history, 'anchor': diloco.engine.anchor,
            'outer_steps': diloco.engine.steps}


@pytest.mark.timeout(150)
def test_two_replicas_end_bit_identical_and_as_the_fail_fast_diloco(tmp_path):
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    train_together(tmp_path, [('--epochs', str(EPOCHS), '--samples', str(SAMPLES), '--min-replicas', '2',
                               '--local-steps', str(H), '--record', str(p)) for p in paths], STARTUP + 90)
    seen = [torch.load(p, weights_only=False) for p in paths]
    reference = run_workers(_worker_fail_fast, 2, deadline=STARTUP + 60)
    assert seen[0]['outer_steps'] == seen[1]['outer_steps'] == reference[0]['outer_steps'] == 5
    for s in seen:
        for mine, theirs in zip(s['anchor'], reference[0]['anchor']):
            assert torch.equal(mine, theirs)  # the same sums in the same order: bit for bit
        for name, value in reference[0]['final'].items():
            assert torch.equal(s['final'][name], value), name
        for theirs, ours in zip(s['history'], reference[0]['history']):
            for key in ('loss', 'acc'):
                assert theirs[key] == pytest.approx(ours[key], rel=1e-6), key
    # Between meetings each replica trained its own shard: their local losses differ.
    assert seen[0]['losses'] != seen[1]['losses']


@pytest.mark.timeout(300)
def test_kill_one_of_three_between_meetings_the_others_go_on_and_the_restarted_one_heals_bit_identical(tmp_path):
    with Lighthouse(bind='127.0.0.1:0', min_replicas=1, join_timeout=15.0, heartbeat_timeout=2.0) as server:
        replicas = Replicas(tmp_path, server.address)
        try:
            stall = kill_one_and_heal(replicas, LOST_BOUND + LOAD_SLACK, '--local-steps', str(H))
        finally:
            replicas.kill_all()
    print('survivors went on {:.1f} s after the kill'.format(stall))


@pytest.mark.timeout(150)
def test_a_replica_that_starts_before_a_meeting_that_ends_an_epoch_joins_at_the_next_epochs_start(tmp_path):
    # 6 steps an epoch, H = 4: meetings after global steps 4, 8, 12 (epoch 1's last), 16 and at the run's end (18).
    # Replica 1 starts while replica 0 waits at its 8th step; the meeting at 12 ends an epoch (one healed there
    # would start an epoch with no batch left), and a round begins with epoch 2: it joins there, at its first batch.
    replicas, late = late_joiner(tmp_path, 4, 8)
    assert replicas.out(late).split()[1:4] == ['STEP', '2', '0'], replicas.describe()
    assert replicas.steps(late) == 6, replicas.describe()


@pytest.mark.timeout(150)
def test_a_replica_waiting_while_every_meeting_ends_an_epoch_joins_at_the_next_epoch_not_alone_after(tmp_path):
    # H = 6, an epoch's steps: every meeting ends an epoch, where no replica joins. Replica 1 starts while replica 0
    # waits at its 2nd step; it used to wait until replica 0's run ended, then train its own model alone (exit 0).
    # It joins at the start of the next epoch its quorum finds (1, or 2 where it was slow to ask), where a round begins.
    replicas, late = late_joiner(tmp_path, 6, 2)
    _, epoch, batch = replicas.out(late).split()[1:4]
    assert int(epoch) in (1, 2) and batch == '0', replicas.describe()
    assert replicas.steps(late) == 6 * (3 - int(epoch)), replicas.describe()
