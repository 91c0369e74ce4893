"""Epoch metrics and predictions of 2 ranks equal those over the union of their samples (issue 8, items 4 and 5).

One launch runs every scenario (run_in_step); the parent computes the references: the per-sample
mean over all samples directly, and one process at batch 2B where its batches are all full.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchbearer import Trial, metrics
from torchbearer.metrics import EpochLambda
from torchbearer.metrics.roc_auc_score import RocAucScore

import torchbearer_dist
from torchbearer_dist.callbacks.metrics import batch_size

from _dist import run_in_step, run_workers, scenario_values

VAL = 101  # odd: a padding DistributedSampler repeats one sample; at batch 32 the last batches are ragged
B = 32


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _data(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _median_error(y_pred, y_true):  # not a mean: must be computed on the gathered outputs
    return (y_pred.softmax(1).max(1).values - y_true.float() / 2).abs().median().item()


def _class_error(y_pred, y_true):  # one value per sample
    return (y_pred.argmax(1) - y_true).abs().float()


def _metrics():
    errors = metrics.MetricTree(metrics.BatchLambda('error', _class_error))
    errors.add_child(metrics.ToDict(metrics.Mean('error')))
    errors.add_child(metrics.ToDict(metrics.Std('error_std')))
    return ['loss', 'acc', errors, RocAucScore(one_hot_classes=3),
            metrics.ToDict(EpochLambda('median', _median_error, running=False))]


def _loader(dataset, batch, shuffle=False):
    world, rank = torchbearer_dist.get_world_size(), torchbearer_dist.get_rank()
    sampler = DistributedSampler(dataset, world, rank, shuffle=shuffle, seed=3)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def _padded_trial():
    model = _model()
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), metrics=_metrics(),
                  callbacks=[torchbearer_dist.ReduceMetrics()], verbose=0)
    return trial.with_generators(val_generator=_loader(TensorDataset(*_data(VAL, 2)), B))


def _evaluate_padded():
    return _padded_trial().evaluate(data_key=torchbearer.VALIDATION_DATA)


def _train_at(batch, distributed):
    """4 epochs on 128 samples: full batches, so one process's batch-mean average is the per-sample mean too."""
    model = _model()
    callbacks = torchbearer_dist.distributed_callbacks() if distributed else [torchbearer_dist.SetSamplerEpoch()]
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), metrics=_metrics(),
                  callbacks=callbacks, verbose=0)
    train, val = TensorDataset(*_data(128, 1)), TensorDataset(*_data(128, 4))
    trial.with_generators(train_generator=_loader(train, batch, shuffle=True), val_generator=_loader(val, batch))
    return trial.run(4)


class _Structured(Dataset):
    """Inputs as a dict of two tensors and targets as a list: the batch size must come from inside them."""

    def __init__(self):
        self.x, self.y = _data(VAL, 5)

    def __len__(self):
        return VAL

    def __getitem__(self, i):
        return {'a': self.x[i, :2], 'b': self.x[i, 2:]}, [self.y[i]]


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = _model()

    def forward(self, x, state=None):
        return self.linear(torch.cat([x['a'], x['b']], 1))


def _structured_loss(state):
    return nn.functional.cross_entropy(state[torchbearer.Y_PRED], state[torchbearer.Y_TRUE][0])


def _evaluate_structured():
    model = _DictModel()
    trial = Trial(model, None, _structured_loss, metrics=['loss'], callbacks=[torchbearer_dist.ReduceMetrics()],
                  verbose=0)
    trial.with_generators(val_generator=_loader(_Structured(), 10))
    return trial.evaluate(data_key=torchbearer.VALIDATION_DATA)


def _predict(gather):
    model = _model()
    trial = Trial(model, callbacks=[torchbearer_dist.ReduceMetrics(gather_predictions=gather)], verbose=0)
    trial.with_generators(test_generator=_loader(TensorDataset(_data(VAL, 6)[0]), 16, shuffle=True))
    return trial.predict()


def _worker_scenarios():
    torch.set_num_threads(1)
    return run_in_step([('padded', _evaluate_padded), ('two_ranks', lambda: _train_at(B, True)),
                        ('structured', _evaluate_structured), ('predict', lambda: _predict(True)),
                        ('predict_local', lambda: _predict(False)), ('rank', dist.get_rank)])


@pytest.fixture(scope='module')
def reported():
    return run_workers(_worker_scenarios, 2)


def _direct(x, y):
    """The per-sample figures over all samples at once, computed without torchbearer."""
    import sklearn.metrics
    with torch.no_grad():
        logits = _model()(x)
    return {'loss': nn.functional.cross_entropy(logits, y).item(), 'acc': (logits.argmax(1) == y).float().mean().item(),
            'roc_auc_score': sklearn.metrics.roc_auc_score(torch.eye(3)[y].numpy(), logits.numpy()),
            'median': _median_error(logits, y), 'error': _class_error(logits, y).mean().item(),
            'error_std': _class_error(logits, y).std().item()}


@pytest.mark.slow
def test_padded_ragged_validation_equals_the_per_sample_figures(reported):
    rank0, rank1 = scenario_values(reported, 'padded')
    assert rank0 == rank1
    direct = _direct(*_data(VAL, 2))
    batch_means = [nn.functional.cross_entropy(_model()(x), y).item() for x, y in
                   DataLoader(TensorDataset(*_data(VAL, 2)), batch_size=2 * B)]
    print('val_loss {:.6f}, per-sample mean {:.6f}, one process at 2B (mean of batch means) {:.6f}'.format(
        rank0['val_loss'], direct['loss'], sum(batch_means) / len(batch_means)))
    for name, value in direct.items():
        torch.testing.assert_close(rank0['val_' + name], value, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_report_what_one_process_at_2b_reports(reported):
    rank0, rank1 = scenario_values(reported, 'two_ranks')
    steps = ('train_steps', 'validation_steps')
    alone = _train_at(2 * B, False)
    assert [{k: v for k, v in e.items() if k not in steps} for e in rank0] == \
        [{k: v for k, v in e.items() if k not in steps} for e in rank1]
    assert set(alone[0]) <= set(rank0[0])  # every figure of one process; distributed_callbacks may add its own
    for mine, reference in zip(rank0, alone):
        for name in reference:
            if name not in steps:
                torch.testing.assert_close(mine[name], reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_batch_size_is_counted_inside_dict_and_list_batches(reported):
    rank0, rank1 = scenario_values(reported, 'structured')
    x, y = _data(VAL, 5)
    torch.testing.assert_close(rank0['val_loss'], _direct(x, y)['loss'], rtol=0, atol=1e-6)
    assert rank1 == rank0


@pytest.mark.slow
def test_predict_returns_the_whole_dataset_in_order_on_every_rank(reported):
    with torch.no_grad():
        expected = _model()(_data(VAL, 6)[0])
    for predictions in scenario_values(reported, 'predict'):
        torch.testing.assert_close(predictions, expected, rtol=0, atol=1e-6)
    local = scenario_values(reported, 'predict_local')
    assert [len(p) for p in local] == [51, 50]  # the padding repeat dropped; no gathering


def test_batch_size_of_tensors_lists_and_dicts():
    assert batch_size({torchbearer.X: torch.zeros(5, 2)}) == 5
    assert batch_size({torchbearer.X: [torch.zeros(4, 2), torch.zeros(4)], torchbearer.Y_TRUE: [torch.zeros(4)]}) == 4
    assert batch_size({torchbearer.X: {'a': torch.zeros(3, 1)}, torchbearer.Y_TRUE: {'y': torch.zeros(3)}}) == 3


def test_one_process_counts_a_ragged_batch_by_its_samples():
    assert _evaluate_padded()['val_loss'] == pytest.approx(_direct(*_data(VAL, 2))['loss'], abs=1e-6)


def _worker_alone(done, wait):
    if dist.get_rank() == 1:  # never calls evaluate: waits until rank 0 is done, at most `wait` seconds
        deadline = time.monotonic() + wait
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    trial = _padded_trial()
    started = time.monotonic()
    try:
        trial.evaluate(data_key=torchbearer.VALIDATION_DATA)
        result = 'evaluate returned', 0.0
    except RuntimeError as error:
        result = str(error), time.monotonic() - started
    open(done, 'w').close()
    return result


@pytest.mark.slow
def test_evaluate_on_one_rank_alone_says_it_is_a_collective(tmp_path):
    # The check-in waits the rendezvous timeout, which is also the heartbeat's limit. At 3 s it failed once
    # after 0.05 s on a machine loaded 6x its cores, under a message naming the 3 s: most likely a call of
    # rank 0 holding the GIL, stretched past 3 s by the load, so that rank 1 named rank 0 silent (holding
    # rank 0's GIL for 4 s does exactly that). 10 s leaves the heartbeat that headroom; a barrier that fails
    # before its timeout is now re-raised for the group to name its cause, not called a missing rank.
    timeout = 10
    wait = 10 * timeout  # without the check-in's own timeout, rank 0 would wait as long as rank 1 does
    message, elapsed = run_workers(_worker_alone, 2, args=(str(tmp_path / 'done'), wait), timeout=timeout,
                                   deadline=wait + 30, group='package')[0]
    assert '\n' not in message
    assert message.startswith('evaluate() is a collective that every rank must call, but not every rank joined '
                              'rank 0 within 10 s (')
    assert message.endswith('); call evaluate() on every rank')
    assert timeout <= elapsed < wait, (message, elapsed)
