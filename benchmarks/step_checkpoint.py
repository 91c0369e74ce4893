"""What a step checkpoint costs training: the example's MLP and the 1.2M-parameter CNN, 2 ranks over gloo.

Each model trains the same steps twice on 2 local ranks (random batches of 64 held in memory, one
thread a rank): once with ``Checkpoint(every_steps=N)`` and once with epoch checkpoints only (none
within the run, which is one epoch). Per checkpoint it reports

- ``write``: rank 0's time inside ``save_step`` (gathering every rank's RNG states, building the
  payload, torch.save, fsync, rename), the median over the run's checkpoints;
- ``stall``: the extra wall time of the whole run with checkpoints, divided by their number: what
  training loses per checkpoint, the other ranks waiting for rank 0 at the next all-reduce;
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
from torchbearer import Trial

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


def _worker(name, steps, every, directory):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build, shape = MODELS[name]
    dataset = TensorDataset(torch.randn(steps * BATCH * tbd.get_world_size(), *shape),
                            torch.randint(0, 10, (steps * BATCH * tbd.get_world_size(),)))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=True))
    results = {}
    for label, every_steps in (('plain', None), ('checkpoints', every)):
        model = build()
        checkpoint = _TimedCheckpoint(os.path.join(directory, '{}.pt'.format(name)), every_steps=every_steps)
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                      torch.nn.functional.cross_entropy, callbacks=[checkpoint, *tbd.distributed_callbacks()],
                      verbose=0).with_generators(loader)
        tbd.sync.collectives.any_rank(False)  # start together
        started = time.perf_counter()
        trial.run(1)
        results[label] = (time.perf_counter() - started, checkpoint.times)
    size = os.path.getsize(os.path.join(directory, '{}.pt'.format(name))) if tbd.get_rank() == 0 else None
    return results, size, sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', type=str, default='mlp,cnn1m', help='comma-separated: mlp, cnn1m')
    parser.add_argument('--steps', type=int, default=200, help='training steps a run')
    parser.add_argument('--every', type=int, default=10, help='steps between checkpoints')
    parser.add_argument('--rounds', type=int, default=2, help='runs of each model')
    args = parser.parse_args()
    print('{:6} {:>10} {:>6} {:>11} {:>11} {:>11} {:>9}'.format('model', 'params', 'ckpts', 'step ms',
                                                               'write ms', 'stall ms', 'size MB'))
    for name in args.models.split(','):
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as directory:
                (results, size, params), *_ = tbd.launch(_worker, 2, args=(name, args.steps, args.every, directory))
            plain, _ = results['plain']
            total, times = results['checkpoints']
            print('{:6} {:>10,} {:>6} {:>11.2f} {:>11.2f} {:>11.2f} {:>9.2f}'.format(
                name, params, len(times), 1000 * plain / args.steps, 1000 * statistics.median(times),
                1000 * (total - plain) / len(times), size / 2 ** 20), flush=True)


if __name__ == '__main__':
    main()
