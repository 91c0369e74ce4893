"""What synchronized BatchNorm costs and what it buys, on 2 ranks over loopback gloo.

Usage::

    python benchmarks/syncbn.py            # accuracy, then interleaved timing; writes benchmarks/results/syncbn.txt
    python benchmarks/syncbn.py --quick    # a smoke run of seconds, writes nothing

Accuracy: 2 ranks at batch B against one process at 2B with plain BatchNorm, after 2 epochs of a
Linear-BatchNorm1d-Tanh-Linear model and of a Conv-BatchNorm2d CNN; the largest absolute difference
per kind of tensor, for converted layers and, for contrast, plain ones.

Timing: four contenders train the same CNN (two BatchNorm2d layers) in a torchbearer Trial: plain
BatchNorm or converted, with ``distributed_callbacks()`` or in torch DistributedDataParallel on CPU
(whose BatchNorm syncs nothing). Each repeat runs every contender once, in an order rotated by one
each repeat; figures are medians over repeats of rank 0's milliseconds per step, by the wall clock
and in CPU time (all of the rank's threads: robust to a busy machine, blind to waiting), and
overheads are medians of ratios taken within the same repeat.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchbearer_dist

CONTENDERS = ('callbacks_bn', 'callbacks_syncbn', 'ddp_bn', 'ddp_syncbn')


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _cnn(seed, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * width, 10))


def _data(kind, n):
    generator = torch.Generator().manual_seed(3)
    shape = (n, 6) if kind == 'mlp' else (n, 3, 16, 16)
    return TensorDataset(torch.randn(*shape, generator=generator) * 2 + 1,
                         torch.randint(0, 3, (n,), generator=generator))


def _trial(model, loader, ddp):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), verbose=0,
                              callbacks=torchbearer_dist.distributed_callbacks(ddp=ddp))
    return trial.with_train_generator(loader)


def _state(model):
    return {k: v.detach().clone() for k, v in torchbearer_dist.sync.models.unwrap(model).state_dict().items()}


def _train_ranks(kind, batch, steps, convert):
    """This rank's model after 2 epochs at ``batch``; rank 0 is seeded like the reference."""
    dataset = _data(kind, 2 * batch * steps)
    model = (_mlp if kind == 'mlp' else _cnn)(1 + dist.get_rank())
    if convert:
        model = torchbearer_dist.convert_sync_batchnorm(model)
    loader = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, shuffle=False))
    _trial(model, loader, ddp=False).run(2)
    return _state(model)


def _train_reference(kind, batch, steps):
    model = (_mlp if kind == 'mlp' else _cnn)(1)
    _trial(model, DataLoader(_data(kind, 2 * batch * steps), batch_size=2 * batch), ddp=False).run(2)
    return _state(model)


def _max_diffs(actual, expected):
    kinds = {}
    for name, value in actual.items():
        kind = name.rsplit('.', 1)[1]
        kind = kind if kind in ('running_mean', 'running_var', 'num_batches_tracked') else 'parameters'
        diff = (value.double() - expected[name].double()).abs().max().item()
        kinds[kind] = max(kinds.get(kind, 0.0), diff)
    return kinds


def _contender(name, batch, steps):
    ddp = name.startswith('ddp')
    dataset = _data('cnn', 2 * batch * steps)
    model = _cnn(0)
    if name.endswith('syncbn'):
        model = torchbearer_dist.convert_sync_batchnorm(model)
    if ddp:
        model = torchbearer_dist.wrap_ddp(model, device='cpu')
    return _trial(model, DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, shuffle=False)),
                  ddp)


def _worker(batch, steps, repeats, check_steps):
    torch.set_num_threads(1)
    accuracy = {(kind, convert): _train_ranks(kind, 4, check_steps, convert)
                for kind in ('mlp', 'cnn') for convert in (True, False)}
    trials = {name: _contender(name, batch, steps) for name in CONTENDERS}
    for trial in trials.values():
        trial.run(1)  # warm-up epoch, discarded
    timings = []
    for repeat in range(repeats):
        order = CONTENDERS[repeat % len(CONTENDERS):] + CONTENDERS[:repeat % len(CONTENDERS)]
        row = {}
        for name in order:
            trial = trials[name]
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            trial.run(len(trial.state[torchbearer.HISTORY]) + 1)
            cpu = time.process_time() - cpu  # every thread of this rank, gloo's included; no waiting
            dist.barrier()
            row[name] = ((time.perf_counter() - started) * 1000 / steps, cpu * 1000 / steps)
        timings.append(row)
    return {'accuracy': accuracy, 'timings': timings}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run: few steps, 2 repeats')
    parser.add_argument('--repeats', type=int, default=None, help='timed runs per contender (default 15, quick 2)')
    parser.add_argument('--steps', type=int, default=None, help='steps per timed run (default 40, quick 4)')
    parser.add_argument('--batch-size', type=int, default=32, help='samples per step on each rank')
    parser.add_argument('--out', type=str, default=None,
                        help='where to write the report (default benchmarks/results/syncbn.txt; none with --quick)')
    args = parser.parse_args(argv)
    out = args.out or (None if args.quick else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                                                            'syncbn.txt'))
    repeats = args.repeats or (2 if args.quick else 15)
    steps = args.steps or (4 if args.quick else 40)
    check_steps = 3 if args.quick else 10
    load_before = os.getloadavg()[0]
    rank0 = torchbearer_dist.launch(_worker, 2, args=(args.batch_size, steps, repeats, check_steps), timeout=120)[0]

    lines = ['Difference to one process at 2x the batch after 2 epochs (max abs, per kind of tensor):']
    for kind in ('mlp', 'cnn'):
        reference = _train_reference(kind, 4, check_steps)
        for convert in (True, False):
            diffs = _max_diffs(rank0['accuracy'][(kind, convert)], reference)
            figures = '  '.join('{} {:.1e}'.format(k, v) for k, v in sorted(diffs.items()))
            lines.append('  {:4} {:23} {}'.format(kind, 'convert_sync_batchnorm' if convert else 'plain BatchNorm',
                                                  figures))
    timings = rank0['timings']
    lines += ['', 'CNN with 2 BatchNorm2d layers, batch {} per rank, 2 ranks over loopback gloo, 1 thread each;'
              .format(args.batch_size),
              'machine: {} cores, load average {:.1f} before and {:.1f} after (a busy machine inflates every '
              'synchronization)'.format(os.cpu_count(), load_before, os.getloadavg()[0]),
              'ms per step on rank 0, median [min, max] of {} interleaved repeats of {} steps:'.format(repeats, steps),
              '  {:17} {:>24} {:>24}'.format('', 'wall clock', 'CPU time (all threads)')]
    for name in CONTENDERS:
        cells = []
        for i in (0, 1):
            values = [row[name][i] for row in timings]
            cells.append('{:.2f} [{:.2f}, {:.2f}]'.format(statistics.median(values), min(values), max(values)))
        lines.append('  {:17} {:>24} {:>24}'.format(name, *cells))
    lines.append('Overhead, median of the ratios within each repeat (wall clock, CPU time):')
    for slow, fast in (('callbacks_syncbn', 'callbacks_bn'), ('ddp_syncbn', 'ddp_bn'), ('callbacks_syncbn', 'ddp_bn')):
        ratios = [statistics.median(row[slow][i] / row[fast][i] for row in timings) for i in (0, 1)]
        lines.append('  {:17} / {:13} {:.3f}  {:.3f}'.format(slow, fast, *ratios))
    text = '\n'.join(lines) + '\n'
    print(text, end='')
    if out is not None:
        with open(out, 'w') as f:
            f.write(text)


if __name__ == '__main__':
    main()
