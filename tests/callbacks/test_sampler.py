"""Under SetSamplerEpoch a shuffling DistributedSampler reshuffles each epoch; the ranks' shards partition the data.

Also (issue 8, item 7): an unsharded training loader is warned about once, on rank 0; distributed_loader
shards a dataset so that 2 ranks at batch B see, batch for batch, what one process at 2B sees.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchbearer import Callback, Trial

import torchbearer_dist

from _dist import run_workers

N = 20
EPOCHS = 3


class _Indexed(Dataset):
    """Sample i is (i, i): the index travels through the loader."""

    def __len__(self):
        return N

    def __getitem__(self, index):
        return torch.tensor([float(index)]), torch.tensor([float(index)])


class _Seen(Callback):
    """Records the indices of each epoch's training samples, in order."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def on_sample(self, state):
        indices = state[torchbearer.X].reshape(-1).long().tolist()
        self.seen.setdefault(state[torchbearer.EPOCH], []).extend(indices)


def _run(callbacks, batch_sampler=False):
    sampler = DistributedSampler(_Indexed(), shuffle=True, seed=7)
    if batch_sampler:
        loader = DataLoader(_Indexed(), batch_sampler=BatchSampler(sampler, batch_size=4, drop_last=False))
    else:
        loader = DataLoader(_Indexed(), batch_size=4, sampler=sampler)
    val_sampler = DistributedSampler(_Indexed(), shuffle=True, seed=7)
    seen = _Seen()
    model = nn.Linear(1, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), callbacks=[*callbacks, seen],
                  verbose=0)
    trial.with_generators(train_generator=loader, val_generator=DataLoader(_Indexed(), sampler=val_sampler))
    trial.run(EPOCHS)
    return {'seen': seen.seen, 'val_epoch': val_sampler.epoch}


def _warnings_of(loader, epochs=2):
    model = nn.Linear(1, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(),
                  callbacks=torchbearer_dist.distributed_callbacks(), verbose=0).with_generators(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trial.run(epochs)
        trial.run(epochs + 1)  # a second run of the same Trial: still one warning
    return [str(w.message) for w in caught if 'DistributedSampler' in str(w.message)]


def _batches(loader, epoch):
    torchbearer_dist.SetSamplerEpoch().on_start_epoch({torchbearer.TRAIN_GENERATOR: loader, torchbearer.EPOCH: epoch})
    return [x.reshape(-1).long().tolist() for x, _ in loader]


def _worker_orders():
    torch.set_num_threads(1)
    return {'unsharded': _warnings_of(DataLoader(_Indexed(), batch_size=4)),
            'sharded': _warnings_of(torchbearer_dist.distributed_loader(_Indexed(), batch_size=4)),
            'helper': [_batches(torchbearer_dist.distributed_loader(_Indexed(), batch_size=3, shuffle=True, seed=5),
                                epoch) for epoch in range(2)],
            'set_epoch': _run([torchbearer_dist.SetSamplerEpoch()]),
            'batch_sampler': _run([torchbearer_dist.SetSamplerEpoch()], batch_sampler=True),
            'standard_set': _run(torchbearer_dist.distributed_callbacks()),
            'forgotten': _run([]),
            'rank': dist.get_rank()}


@pytest.fixture(scope='module')
def orders():
    return run_workers(_worker_orders, 2)


def _expected(rank, epoch):
    sampler = DistributedSampler(_Indexed(), num_replicas=2, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.slow
@pytest.mark.parametrize('how', ['set_epoch', 'batch_sampler', 'standard_set'])
def test_order_changes_each_epoch_and_shards_partition_the_data(orders, how):
    rank0, rank1 = orders[0][how]['seen'], orders[1][how]['seen']
    for epoch in range(EPOCHS):
        assert rank0[epoch] == _expected(0, epoch) and rank1[epoch] == _expected(1, epoch)
        assert not set(rank0[epoch]) & set(rank1[epoch])
        assert sorted(rank0[epoch] + rank1[epoch]) == list(range(N))
    assert len({tuple(rank0[epoch]) for epoch in range(EPOCHS)}) == EPOCHS
    assert orders[0][how]['val_epoch'] == orders[1][how]['val_epoch'] == EPOCHS - 1


@pytest.mark.slow
def test_without_set_epoch_every_epoch_repeats_the_order(orders):
    seen = orders[0]['forgotten']['seen']
    assert seen[0] == seen[1] == seen[2] == _expected(0, 0)


@pytest.mark.slow
def test_an_unsharded_training_loader_is_warned_about_once_on_rank_0(orders):
    assert orders[0]['unsharded'] == ['no DistributedSampler is reachable from the training loader (looked at '
                                      'DataLoader, SequentialSampler, BatchSampler), so each of the 2 ranks trains '
                                      'on all of its data; build it with torchbearer_dist.distributed_loader(dataset, '
                                      'batch_size=...) or pass sampler=DistributedSampler(dataset)']
    assert orders[1]['unsharded'] == []
    assert orders[0]['sharded'] == orders[1]['sharded'] == []


@pytest.mark.slow
def test_distributed_loader_gives_two_ranks_at_b_the_batches_of_one_process_at_2b(orders):
    alone = torchbearer_dist.distributed_loader(_Indexed(), batch_size=6, shuffle=True, seed=5)  # no group: one rank
    for epoch in range(2):
        reference = _batches(alone, epoch)
        rank0, rank1 = orders[0]['helper'][epoch], orders[1]['helper'][epoch]
        assert [len(b) for b in rank0] == [3, 3, 3, 1]  # batch_size is per rank: 10 samples each
        assert [sorted(a + b) for a, b in zip(rank0, rank1)] == [sorted(b) for b in reference]
    assert orders[0]['helper'][0] != orders[0]['helper'][1]  # reshuffled by SetSamplerEpoch


def test_distributed_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r'^batch_size should be an integer >= 1 \(samples per rank\), but given 0$'):
        torchbearer_dist.distributed_loader(_Indexed(), batch_size=0)
    with pytest.raises(ValueError, match=r'^distributed_loader builds its own sampler, but given sampler=.*; build the '
                                         r'DataLoader yourself with a DistributedSampler instead$'):
        torchbearer_dist.distributed_loader(_Indexed(), batch_size=2, sampler=list(range(N)))
