"""Print the figures of metrics that are not per-sample means, on N ranks against one process at N x B.

``peak`` is each batch's maximum confidence under torchbearer's ``@running_mean @mean`` (declared
'max' where ``torchbearer_dist.reduce_metric`` exists), ``peak_raw`` the same function undeclared,
``f1_epoch`` a macro F1 as an EpochLambda and ``f1_class`` the same F1 as a Metric class. Two Trials
run in one process, and the warnings rank 0 gives in each are printed. Runs with whichever
torchbearer_dist comes first on PYTHONPATH, so the same numbers can be taken on an older checkout::

    PYTHONPATH=$PWD:$PWD/tests python tests/scripts/metric_reduction_vs_one_process.py [N]
    PYTHONPATH=/path/to/older:$PWD/tests python tests/scripts/metric_reduction_vs_one_process.py [N]
"""
import sys
import warnings

import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial, metrics
from torchbearer.bases import Metric

import torchbearer_dist

import _dist
from _dist import run_workers

_dist.PRELOAD = [m for m in _dist.PRELOAD if m != 'torchbearer_dist']  # ranks import the one PYTHONPATH names

B = 16
_declare = getattr(torchbearer_dist, 'reduce_metric', lambda reduction: (lambda metric: metric))


@metrics.running_mean(step_size=1)
@metrics.mean
@_declare('max')
@metrics.lambda_metric('peak')
def peak(y_pred, y_true):
    return y_pred.softmax(1).max()


@metrics.running_mean(step_size=1)
@metrics.mean
@metrics.lambda_metric('peak_raw')
def peak_raw(y_pred, y_true):
    return y_pred.softmax(1).max()


def _f1(y_pred, y_true):
    guess, scores = y_pred.argmax(1), []
    for c in range(3):
        tp = ((guess == c) & (y_true == c)).sum().item()
        wrong = ((guess == c) != (y_true == c)).sum().item()
        scores.append(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
    return sum(scores) / 3


class F1(Metric):
    def __init__(self):
        super().__init__('f1_class')

    def process(self, state):
        self._pred.append(state[torchbearer.Y_PRED].detach())
        self._true.append(state[torchbearer.Y_TRUE])

    def process_final(self, state):
        return _f1(torch.cat(self._pred), torch.cat(self._true))

    def reset(self, state):
        self._pred, self._true = [], []


METRICS = ['loss', peak, peak_raw, metrics.to_dict(metrics.lambda_metric('f1_epoch', on_epoch=True)(_f1)),
           metrics.to_dict(F1())]
NAMES = ['loss', 'peak', 'running_peak', 'val_peak', 'peak_raw', 'running_peak_raw', 'val_peak_raw', 'f1_epoch',
         'val_f1_epoch', 'f1_class', 'val_f1_class']


def _trial(world, batch, distributed, seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    callbacks = torchbearer_dist.distributed_callbacks() if distributed else [torchbearer_dist.SetSamplerEpoch()]
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), metrics=METRICS,
                  callbacks=callbacks, verbose=0)
    generator = torch.Generator().manual_seed(seed + 1)
    train = TensorDataset(torch.randn(8 * world * B, 4, generator=generator),
                          torch.randint(0, 3, (8 * world * B,), generator=generator))
    val = TensorDataset(torch.randn(101, 4, generator=generator), torch.randint(0, 3, (101,), generator=generator))
    rank = torchbearer_dist.get_rank()
    size = torchbearer_dist.get_world_size()
    trial.with_generators(
        train_generator=DataLoader(train, batch_size=batch, sampler=DistributedSampler(train, size, rank, seed=3)),
        val_generator=DataLoader(val, batch_size=batch, sampler=DistributedSampler(val, size, rank, shuffle=False)))
    return trial.run(2)[-1]


def _two_trials(world, batch, distributed):
    torch.set_num_threads(1)
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('default')  # as a user's program has it
        first = _trial(world, batch, distributed, 0)
        said.append([str(w.message) for w in caught if str(w.message).startswith('torchbearer_dist: metric')])
        start = len(caught)
        second = _trial(world, batch, distributed, 10)
        said.append([str(w.message) for w in caught[start:] if str(w.message).startswith('torchbearer_dist: metric')])
    return (first, second), said, torchbearer_dist.__file__


if __name__ == '__main__':
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    ranks = run_workers(_two_trials, world, args=(world, B, True), deadline=240)
    alone = run_workers(_two_trials, 1, args=(world, world * B, False), deadline=120)[0][0]
    print(torchbearer_dist.__file__, 'on the ranks:', ranks[0][2])
    print('{} ranks at batch {} against one process at {}; last epoch of each Trial'.format(world, B, world * B))
    for t in range(2):
        for name in NAMES:
            mine = [r[0][t][name] for r in ranks]
            print('trial {} {:18s} ranks {}  one process {:.6f}  |rank 0 - one| {:.1e}'.format(
                t + 1, name, ' '.join('{:.6f}'.format(m) for m in mine), alone[t][name], abs(mine[0] - alone[t][name])))
        for message in ranks[0][1][t]:
            print('trial {} rank 0 warned: {}'.format(t + 1, message))
        for rank, r in enumerate(ranks[1:], 1):
            print('trial {} rank {} warned {} times'.format(t + 1, rank, len(r[1][t])))
