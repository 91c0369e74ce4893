"""Reduced epoch metrics equal those over the union of all ranks' data, identical on every rank."""
import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial

import torchbearer_dist

from _dist import run_workers

TRAIN = (12, 8)  # samples of rank 0 and rank 1: the ranks are weighted by samples, not counted
VAL = 101  # odd: a padding DistributedSampler repeats one sample on rank 1


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _train_data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(sum(TRAIN), 4, generator=generator), torch.randint(0, 3, (sum(TRAIN),), generator=generator)


def _val_data():
    generator = torch.Generator().manual_seed(2)
    return torch.randn(VAL, 4, generator=generator), torch.randint(0, 3, (VAL,), generator=generator)


def _worker_metrics(val_batch_size):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x, y = _train_data()
    start = sum(TRAIN[:rank])
    train = DataLoader(TensorDataset(x[start:start + TRAIN[rank]], y[start:start + TRAIN[rank]]), batch_size=4)
    val_set = TensorDataset(*_val_data())
    val = DataLoader(val_set, batch_size=val_batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the model the parent evaluates stays as it is
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[torchbearer_dist.ReduceMetrics()], verbose=0)
    trial.with_generators(train_generator=train, val_generator=val)
    history = trial.run(1)
    evaluated = trial.evaluate(data_key=torchbearer.VALIDATION_DATA)
    return {'history': history, 'evaluated': evaluated, 'sampled': len(val.sampler)}


def _union_metrics(x, y):
    with torch.no_grad():
        logits = _model()(x)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


@pytest.fixture(scope='module')
def reported():
    # One launch; val batches of 51 give each rank one batch, of 10 several, the last one trimmed.
    return run_workers(_worker_metrics_both, 2)


def _worker_metrics_both():
    return {51: _worker_metrics(51), 10: _worker_metrics(10)}


@pytest.mark.slow
def test_every_rank_reports_identical_metrics(reported):
    rank0, rank1 = reported
    steps = ('train_steps', 'validation_steps')  # not metrics: 3 batches on rank 0, 2 on rank 1
    for batch_size in (51, 10):
        history0, history1 = ([{k: v for k, v in epoch.items() if k not in steps}
                               for epoch in rank[batch_size]['history']] for rank in (rank0, rank1))
        assert history0 == history1
        assert 'running_loss' in history0[0]
        assert rank0[batch_size]['evaluated'] == rank1[batch_size]['evaluated']


@pytest.mark.slow
def test_training_metrics_equal_those_over_the_union(reported):
    loss, acc = _union_metrics(*_train_data())
    metrics = reported[0][51]['history'][0]
    torch.testing.assert_close(metrics['acc'], acc)
    torch.testing.assert_close(metrics['loss'], loss)  # equal batch sizes: the mean of batch means is the mean


@pytest.mark.slow
@pytest.mark.parametrize('batch_size', [51, 10])
def test_padded_validation_counts_each_sample_once(reported, batch_size):
    rank0, rank1 = reported
    assert rank0[batch_size]['sampled'] == rank1[batch_size]['sampled'] == 51  # 102 samples: one repeated
    loss, acc = _union_metrics(*_val_data())
    correct = round(acc * VAL)
    assert correct / 102 != pytest.approx(acc)
    for metrics in (rank0[batch_size]['history'][0], rank0[batch_size]['evaluated']):
        torch.testing.assert_close(metrics['val_acc'], correct / VAL)
        if batch_size == 51:  # one batch per rank: the sample-weighted batch means are the mean over 101
            torch.testing.assert_close(metrics['val_loss'], loss)
