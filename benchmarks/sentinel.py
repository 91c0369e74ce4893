"""The cost of the sentinels that are on by default: the divergence sentinel and the data sentinel.

Usage::

    python benchmarks/sentinel.py             # 2 ranks, 5 interleaved repeats of one epoch per model
    python benchmarks/sentinel.py --models example --epochs 5   # the example's own run length
    python benchmarks/sentinel.py --quick     # a smoke run

Two models, each trained for one epoch by a Trial with :func:`torchbearer_dist.distributed_callbacks`,
2 ranks on gloo, one thread per rank: the MNIST example (its 784-100-10 perceptron, 4,000 digits,
batch 32 per rank, from ``example_parts.py``) and the 1.2M-parameter CNN of ``contenders.cnn1m`` (PyTorch's
MNIST example CNN) on 1,024 random 1x28x28 images, batch 32 per rank. The sentinels' own time is measured
directly (every call of :func:`~torchbearer_dist.sync.models.differing_tensors` and of
:func:`~torchbearer_dist.data.check_same_data` is timed inside the run, after an untimed barrier, so that
waiting for a later rank, which the next collective would do anyway, is not counted) and given as a share of the
epoch: a run of one epoch makes two divergence checks (after the first step, at the end of the pass)
and one data check, each further epoch one divergence check ("per epoch"), so the share falls with longer
epochs and runs. The runs with the divergence sentinel on
and off are interleaved; their difference in wall time is printed too, but on a shared machine it is
noise beside the direct figure.
"""
import argparse
import statistics
import time

import contenders
import torch
import torch.distributed as dist
import torchbearer
from example_parts import Net, load_mnist_5k_flat
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchbearer_dist
from torchbearer_dist.callbacks import sampler as sampler_callbacks
from torchbearer_dist.sync import models

BATCH = 32


class _Timed:
    """Wraps a collective and adds up the seconds spent in it, after a barrier (untimed): its own cost, not the
    wait for a rank that arrives later, which the next collective would wait for anyway."""

    def __init__(self, fn):
        self.fn, self.seconds, self.durations = fn, 0.0, []

    def __call__(self, *args, **kwargs):
        dist.barrier()
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.durations.append(time.perf_counter() - start)
            self.seconds += self.durations[-1]


def _data(model_name):
    if model_name == 'example':
        return load_mnist_5k_flat()[0]
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(1024, 1, 28, 28, generator=g), torch.randint(0, 10, (1024,), generator=g))


def _model(model_name):
    torch.manual_seed(0)
    return Net() if model_name == 'example' else contenders.cnn1m()


def _epoch(model_name, dataset, check_divergence, divergence, data, epochs=1):
    model = _model(model_name)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'], verbose=0,
                              callbacks=torchbearer_dist.distributed_callbacks(check_divergence=check_divergence))
    trial.with_train_generator(loader)
    before = divergence.seconds, data.seconds
    start = time.perf_counter()
    trial.run(epochs)
    return time.perf_counter() - start, divergence.seconds - before[0], data.seconds - before[1]


def _worker(model_names, repeats, epochs):
    torch.set_num_threads(1)
    divergence = models.differing_tensors = _Timed(models.differing_tensors)
    data = sampler_callbacks.check_same_data = _Timed(sampler_callbacks.check_same_data)
    results = {}
    for name in model_names:
        dataset = _data(name)
        _epoch(name, dataset, True, divergence, data)  # warm-up
        runs = {True: [], False: []}
        for repeat in range(repeats):
            for flag in ((True, False) if repeat % 2 == 0 else (False, True)):
                runs[flag].append(_epoch(name, dataset, flag, divergence, data, epochs))
        results[name] = {'parameters': sum(p.numel() for p in _model(name).parameters()), 'runs': runs,
                         'check': statistics.median(divergence.durations), 'data': statistics.median(data.durations)}
        divergence.durations, data.durations = [], []
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--models', type=str, default='example,cnn1m')
    parser.add_argument('--epochs', type=int, default=1, help='epochs per run (the example trains 5)')
    parser.add_argument('--quick', action='store_true', help='one repeat of the example only')
    args = parser.parse_args(argv)
    names = ['example'] if args.quick else args.models.split(',')
    repeats = 1 if args.quick else args.repeats
    per_rank = torchbearer_dist.launch(_worker, args.ranks, args=(names, repeats, args.epochs), timeout=120)
    print('{} ranks, gloo, 1 thread per rank, batch {} per rank, {} epoch(s) per run, {} runs each way'.format(
        args.ranks, BATCH, args.epochs, repeats))
    print('{:8} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>10} {:>9}'.format(
        'model', 'params', 'run on', 'run off', 'on - off', 'divergence', 'share/run', 'per epoch', 'data check',
        'share'))
    for name in names:
        worst = None
        for results in per_rank:  # the rank where the sentinels weigh most
            runs = results[name]['runs']
            row = (statistics.median(r[0] for r in runs[True]), statistics.median(r[0] for r in runs[False]),
                   statistics.median(r[1] for r in runs[True]), results[name]['check'],
                   statistics.median(r[2] for r in runs[True]))
            worst = row if worst is None or row[2] / row[0] > worst[2] / worst[0] else worst
        run_on, run_off, divergence, check, data = worst
        epoch = run_on / args.epochs
        # A run checks after its first step and at the end of every training pass: epochs + 1 checks.
        print('{:8} {:>10,} {:>8.3f}s {:>8.3f}s {:>+8.3f}s {:>8.2f}ms {:>9.2f}% {:>8.2f}% {:>8.2f}ms {:>8.2f}%'.format(
            name, per_rank[0][name]['parameters'], run_on, run_off, run_on - run_off, check * 1e3,
            100 * divergence / run_on, 100 * check / epoch, data * 1e3, 100 * data / run_on))


if __name__ == '__main__':
    main()
