"""What a step checkpoint costs training: the example's MLP and the 1.2M-parameter CNN, 2 ranks over gloo.

Each model trains on 2 local ranks (random batches of 64 held in memory, one thread a rank) with
``Checkpoint(every_steps=N)``; a callback at the end of the list stamps the end of every step on
every rank. Per checkpoint it reports

- ``write``: rank 0's time inside ``save_step`` (gathering every rank's RNG states, building the
  payload, torch.save, fsync, rename), the median over the run's checkpoints;
- ``stall``: what training loses per checkpoint: on each rank, the two steps around a checkpoint
  (the one that ends with it and the next, in which the other ranks wait for rank 0 at the
  gradient all-reduce) less two median steps without one; the larger rank's, median over checkpoints;
- ``size``: the checkpoint file's size.

Usage::

    python benchmarks/step_checkpoint.py                     # both models, 2 rounds each
    python benchmarks/step_checkpoint.py --models mlp --steps 400 --every 20
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from contenders import cnn1m  # noqa: E402
from example_parts import Net  # noqa: E402

import torchbearer_dist as tbd  # noqa: E402

MODELS = {'mlp': (Net, (784,)), 'cnn1m': (cnn1m, (1, 28, 28))}
BATCH = 64


class _TimedCheckpoint(tbd.Checkpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times = []

    def save_step(self, state):
        started = time.perf_counter()
        super().save_step(state)
        self.times.append(time.perf_counter() - started)


class _StepClock(Callback):
    def __init__(self):
        super().__init__()
        self.stamps = []

    def on_step_training(self, state):
        self.stamps.append(time.perf_counter())


def _worker(name, steps, every, directory):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build, shape = MODELS[name]
    count = (steps + 1) * BATCH * tbd.get_world_size()
    dataset = TensorDataset(torch.randn(count, *shape), torch.randint(0, 10, (count,)))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=True))
    model = build()
    path = os.path.join(directory, '{}.pt'.format(name))
    checkpoint, clock = _TimedCheckpoint(path, every_steps=every), _StepClock()
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                  torch.nn.functional.cross_entropy, callbacks=[checkpoint, *tbd.distributed_callbacks(), clock],
                  verbose=0).with_generators(loader)
    trial.run(1)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]  # steps[i]: the step ending at stamp i + 1
    saved = {i - 1 for i in range(every, len(clock.stamps) + 1, every)}  # stamps of steps that checkpointed
    around = [steps[i - 1] + steps[i] for i in sorted(saved) if 1 <= i < len(steps)]
    plain = statistics.median(d for i, d in enumerate(steps) if i + 1 not in saved and i not in saved)
    size = os.path.getsize(path) if tbd.get_rank() == 0 else None
    return dict(write=checkpoint.times, around=around, plain=plain, size=size,
                params=sum(p.numel() for p in model.parameters()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', type=str, default='mlp,cnn1m', help='comma-separated: mlp, cnn1m')
    parser.add_argument('--steps', type=int, default=100, help='training steps a run')
    parser.add_argument('--every', type=int, default=10, help='steps between checkpoints')
    parser.add_argument('--rounds', type=int, default=2, help='runs of each model')
    args = parser.parse_args()
    print('{:6} {:>10} {:>6} {:>9} {:>9} {:>9} {:>8}'.format('model', 'params', 'ckpts', 'step ms', 'write ms',
                                                              'stall ms', 'size MB'))
    for name in args.models.split(','):
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as directory:
                ranks = tbd.launch(_worker, 2, args=(name, args.steps, args.every, directory))
            zero = ranks[0]
            stall = statistics.median(max(r['around'][i] - 2 * r['plain'] for r in ranks)
                                      for i in range(len(zero['around'])))
            print('{:6} {:>10,} {:>6} {:>9.2f} {:>9.2f} {:>9.2f} {:>8.2f}'.format(
                name, zero['params'], len(zero['write']), 1000 * zero['plain'], 1000 * statistics.median(zero['write']),
                1000 * stall, zero['size'] / 2 ** 20), flush=True)


if __name__ == '__main__':
    main()
