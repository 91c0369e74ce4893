"""The cost of following a trainable set that changes during a run: the check at every step, and a rebuild.

Usage::

    python benchmarks/trainable_set.py            # 2 ranks, 5 interleaved repeats of one epoch each way
    python benchmarks/trainable_set.py --quick    # a smoke run

The MNIST example (its 784-100-10 perceptron, 4,000 digits, batch 32 per rank, from ``example_parts.py``)
trained by a Trial with :func:`torchbearer_dist.distributed_callbacks`, 2 ranks on gloo, one thread
per rank. Three kinds of run, interleaved repeat by repeat:

- *check on*: the package as it is. Every call of the check that a training step makes (at
  ``on_sample`` and at each forward pass: :meth:`TrainableSet.sense`, one ``requires_grad`` read
  per parameter and one length per param group) is timed inside the run; the per-step figure is the
  sum of a step's calls;
- *check off*: the same, with the check replaced by one that sees nothing (the wall-time difference
  is printed too; on a shared machine it is noise beside the direct figure);
- *unfreeze*: the hidden layer starts frozen and a callback listed after the package's unfreezes it
  and adds a param group at batch 10 of the first epoch. The rebuild (:meth:`AllReduceGradients._follow`:
  the agreement of the ranks, the averaging of that step's new gradients, new buckets) is timed after
  an untimed barrier, so that waiting for the other rank is not counted.

Also printed: the alternative check, recomputing the trainable set (a walk of the Trial's state, as a
rebuild does: :meth:`AllReduceGradients._wanted`) and comparing identities, timed on the same live
state, for comparison with the cheap check.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torchbearer
from example_parts import Net, load_mnist_5k_flat
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import torchbearer_dist
from torchbearer_dist.callbacks.gradients import AllReduceGradients

#: The object of AllReduceGradients that senses a change (its module is private: reached through the callback).
TrainableSet = type(AllReduceGradients().trainable_set)
BATCH = 32
UNFREEZE_AT = 10


class _Timed:
    """Adds up the seconds of every call of a method; with ``barrier``, after an untimed barrier."""

    def __init__(self, fn, barrier=False):
        self.fn, self.barrier, self.durations = fn, barrier, []

    def __get__(self, obj, objtype=None):
        def call(*args, **kwargs):
            if self.barrier:
                dist.barrier()
            start = time.perf_counter()
            try:
                return self.fn(obj, *args, **kwargs)
            finally:
                self.durations.append(time.perf_counter() - start)
        return call


class _Unfreeze(torchbearer.callbacks.Callback):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def on_sample(self, state):
        if state[torchbearer.EPOCH] == 0 and state[torchbearer.BATCH] == UNFREEZE_AT:
            for p in self.model.hidden.parameters():
                p.requires_grad = True
            state[torchbearer.OPTIMIZER].add_param_group({'params': list(self.model.hidden.parameters())})


def _run(dataset, kind, extra_checks):
    torch.manual_seed(0)
    model = Net()
    if kind == 'unfreeze':
        for p in model.hidden.parameters():
            p.requires_grad = False
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=0))
    callbacks = torchbearer_dist.distributed_callbacks()
    if kind == 'unfreeze':
        callbacks.append(_Unfreeze(model))
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'], verbose=0,
                              callbacks=callbacks)
    trial.with_train_generator(loader)
    gradients = next(c for c in callbacks if isinstance(c, AllReduceGradients))
    start = time.perf_counter()
    trial.run(1)
    seconds = time.perf_counter() - start
    state = trial.state
    for _ in range(extra_checks):  # the alternative check, on the live state
        begin = time.perf_counter()
        _ = {id(p) for _, p in gradients._wanted(state)} != set()
        _RECOMPUTE.append(time.perf_counter() - begin)
    return seconds, len(loader)


_RECOMPUTE = []


def _worker(repeats):
    torch.set_num_threads(1)
    dataset = load_mnist_5k_flat()[0]
    sense = _Timed(TrainableSet.sense)
    follow = _Timed(AllReduceGradients._follow, barrier=True)
    TrainableSet.sense, AllReduceGradients._follow = sense, follow
    blind = lambda self, state: False  # noqa: E731  (the check that sees nothing)
    _run(dataset, 'on', 0)  # warm-up
    sense.durations, follow.durations, _RECOMPUTE[:] = [], [], []
    runs = {'on': [], 'off': [], 'unfreeze': []}
    steps = None
    for repeat in range(repeats):
        order = ('on', 'off', 'unfreeze') if repeat % 2 == 0 else ('unfreeze', 'off', 'on')
        for kind in order:
            TrainableSet.sense = blind if kind == 'off' else sense
            calls = len(sense.durations)
            seconds, steps = _run(dataset, kind, 200 if kind == 'on' else 0)
            runs[kind].append((seconds, len(sense.durations) - calls))
    TrainableSet.sense = sense
    return {'runs': runs, 'steps': steps, 'sense': statistics.median(sense.durations),
            'follow': statistics.median(follow.durations), 'follows': len(follow.durations) // repeats,
            'recompute': statistics.median(_RECOMPUTE),
            'parameters': sum(p.numel() for p in Net().parameters())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--quick', action='store_true', help='one repeat')
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    per_rank = torchbearer_dist.launch(_worker, args.ranks, args=(repeats,), timeout=120)
    print('{} ranks, gloo, 1 thread per rank, the example (784-100-10, {:,} parameters), batch {} per rank, one '
          'epoch of {} steps per run, {} runs each way, medians'.format(
              args.ranks, per_rank[0]['parameters'], BATCH, per_rank[0]['steps'], repeats))
    for rank, r in enumerate(per_rank):
        on = statistics.median(s for s, _ in r['runs']['on'])
        off = statistics.median(s for s, _ in r['runs']['off'])
        unfreeze = statistics.median(s for s, _ in r['runs']['unfreeze'])
        step = on / r['steps']
        calls = statistics.median(c for _, c in r['runs']['on']) / r['steps']
        print('rank {}: epoch {:.3f} s check on, {:.3f} s off ({:+.3f} s), {:.3f} s with one unfreezing; step {:.2f} ms'
              .format(rank, on, off, on - off, unfreeze, step * 1e3))
        print('  check: {:.2f} us a call, {:.1f} calls a step: {:.2f} us a step ({:.3f} % of a step); recomputing the '
              'trainable set instead: {:.2f} us a call'.format(r['sense'] * 1e6, calls, r['sense'] * calls * 1e6,
                                                              100 * r['sense'] * calls / step, r['recompute'] * 1e6))
        print('  rebuild: {:.2f} ms ({} per unfreezing run; {:.1f} steps\' worth)'.format(
            r['follow'] * 1e3, r['follows'], r['follow'] / step))


if __name__ == '__main__':
    main()
