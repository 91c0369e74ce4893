"""The fault-tolerant mode's promise: two replicas train as one process at 2 x batch.

Two real replicas (tests/ft/_replica.py) with a real lighthouse, both in every step's quorum
(``min_replicas=2``), each with the user's own callbacks around ours: one before them in the Trial's list
that clips the gradients at ``on_backward``, one after them that records the loss of every step. The
reference is one plain Trial in this process over the concatenated batches (replica 0's samples, then
replica 1's, as their DistributedSamplers split them), from the weights torchft's ``init_sync`` gives
everyone at the first step: replica 0's, the first of the sorted quorum.
"""
import pytest
import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler

from _dist import LOAD_SLACK, STARTUP

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')

from _replica import ClipGradients, Record, dataset, model  # noqa: E402
from _replicas import train_together  # noqa: E402
from test_torchrun_restarts import Torchrun  # noqa: E402

SAMPLES, EPOCHS, BATCH = 120, 2, 10  # 6 steps an epoch on each replica


class _Concatenated:
    """The batches of shard 0, then shard 1, ... (replica 0's, then replica 1's; in replica groups, each group's
    ranks in order), step by step, one epoch per ``iter()`` (set_epoch as ours)."""

    def __init__(self, data, shards=2):
        self.samplers = [DistributedSampler(data, num_replicas=shards, rank=r, seed=0) for r in range(shards)]
        self.epoch = 0

    def __iter__(self):
        shards = []
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        self.epoch += 1
        for k in range(0, len(shards[0]), BATCH):
            yield [i for shard in shards for i in shard[k:k + BATCH]]

    def __len__(self):
        return -(-len(self.samplers[0]) // BATCH)


def _reference(start, shards=2, samples=SAMPLES):
    net = model(0, 32)
    net.load_state_dict(start)
    clip, record = ClipGradients(0.25), Record()
    trial = torchbearer.Trial(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                              torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'], callbacks=[clip, record])
    data = dataset(samples)
    trial.with_generators(DataLoader(data, batch_sampler=_Concatenated(data, shards)))
    history = trial.run(EPOCHS, verbose=0)
    return net.state_dict(), clip, record, history


@pytest.mark.timeout(150)
def test_two_replicas_train_as_one_process_at_twice_the_batch(tmp_path):
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    train_together(tmp_path, [('--epochs', str(EPOCHS), '--samples', str(SAMPLES), '--min-replicas', '2', '--record',
                               str(p)) for p in paths], STARTUP + 90)
    seen = [torch.load(p, weights_only=False) for p in paths]
    # Both started from replica 0's own initial weights (init_sync), which differ from replica 1's.
    for name, value in seen[0]['initial'].items():
        assert not torch.equal(value, seen[1]['initial'][name])
        for r in range(2):
            assert torch.equal(seen[r]['start'][name], value), (r, name)
    final, clip, record, history = _reference(seen[0]['start'])
    steps = EPOCHS * SAMPLES // (2 * BATCH)
    assert len(record.losses) == steps and all(len(s['losses']) == steps for s in seen)
    # Every on_backward callback, before or after ours, saw the averaged gradients: the reference's.
    assert min(clip.norms) > 0.25  # the clip acted at every step, so clipping local gradients would differ
    for s in seen:
        torch.testing.assert_close(s['clipped'], clip.norms, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s['norms'], record.norms, rtol=1e-5, atol=1e-6)
    # Each replica's loss is its half of the batch; their mean is the whole batch's.
    torch.testing.assert_close([(a + b) / 2 for a, b in zip(seen[0]['losses'], seen[1]['losses'])], record.losses,
                               rtol=1e-5, atol=1e-6)
    for s in seen:
        for name, value in final.items():
            torch.testing.assert_close(s['final'][name], value, rtol=1e-5, atol=1e-6)
        for theirs, ours in zip(s['history'], history):
            assert sorted(theirs) == sorted(ours)
            for key in ('loss', 'acc', 'running_loss', 'running_acc'):
                assert theirs[key] == pytest.approx(ours[key], rel=1e-5, abs=1e-6), key
    assert seen[0]['final'].keys() == final.keys()
    for name in final:  # the replicas hold the same weights, bit for bit
        assert torch.equal(seen[0]['final'][name], seen[1]['final'][name])


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 120)
def test_two_replica_groups_of_two_ranks_train_as_one_process_at_four_times_the_batch(tmp_path):
    # Each replica a torchrun job of two ranks (issue 43): rank r of group g trains shard 2g + r of 4. The average
    # goes within the group, across the groups (each rank's half), and back; the user's callbacks on every rank,
    # before and after ours, see the reference's gradients, and every rank starts from group 0's rank 0's weights.
    samples = 2 * SAMPLES  # 6 steps an epoch on each rank
    paths = [tmp_path / 'r{}.pt'.format(r) for r in range(2)]
    train_together(tmp_path, [('--epochs', str(EPOCHS), '--samples', str(samples), '--min-replicas', '2', '--record',
                               str(p)) for p in paths], 2 * (STARTUP + LOAD_SLACK) + 60,
                   hosts=Torchrun(ranks=2, restarts=0))
    seen = [torch.load('{}.rank{}'.format(p, k), weights_only=False) for p in paths for k in range(2)]  # shards 0-3
    for s in seen[1:]:
        for name, value in seen[0]['start'].items():
            assert torch.equal(s['start'][name], value), name
    final, clip, record, history = _reference(seen[0]['start'], shards=4, samples=samples)
    steps = EPOCHS * samples // (4 * BATCH)
    assert len(record.losses) == steps and all(len(s['losses']) == steps for s in seen)
    assert min(clip.norms) > 0.25
    for s in seen:
        torch.testing.assert_close(s['clipped'], clip.norms, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s['norms'], record.norms, rtol=1e-5, atol=1e-6)
        for name, value in final.items():
            torch.testing.assert_close(s['final'][name], value, rtol=1e-5, atol=1e-6)
        for theirs, ours in zip(s['history'], history):
            for key in ('loss', 'acc', 'running_loss', 'running_acc'):
                assert theirs[key] == pytest.approx(ours[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close([sum(s['losses'][i] for s in seen) / 4 for i in range(steps)], record.losses,
                               rtol=1e-5, atol=1e-6)
    for s in seen[1:]:  # every rank of both groups holds the same weights, bit for bit
        for name in final:
            assert torch.equal(s['final'][name], seen[0]['final'][name]), name
