"""Where a data-parallel step spends its time: forward, backward, wait for the average, optimizer step.

A plain training loop (no Trial) per rank, run by ``python benchmarks/multihost.py --phases`` in the
namespace hosts. Contenders, interleaved: torch DDP; our bucket engine
(:class:`~torchbearer_dist.sync.buckets.GradientBuckets`) as configured by default; and the same engine
with the bucket schedule it had before (a bucket closed *before* the tensor that overflows it, no
reordering). Our engine completes the average at the end of backward, in an autograd callback:
"wait" is the time spent in that callback, and "backward" the rest of ``loss.backward()``. DDP's
wait happens inside its backward, which includes communication.
"""
import statistics
import time

import contenders
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import FlatBucket

PHASES = ('forward', 'backward', 'wait', 'optimizer', 'step')


def _close_before(params, cap_mb, first_mb):
    """The schedule before issue 9: a bucket closed before the tensor that would overflow it."""
    buckets, current, size, cap = [], [], 0, first_mb * 2 ** 20
    for p in params:
        if current and size + p.numel() * p.element_size() > cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2 ** 20
        current.append(p)
        size += p.numel() * p.element_size()
    buckets.append(current)
    return [FlatBucket(b, i == len(buckets) - 1) for i, b in enumerate(buckets)]


class _Loop:
    def __init__(self, name, model_name):
        build, shape = contenders.MODELS[model_name]
        torch.manual_seed(0)
        model = build()
        self.buckets = None
        if name == 'ddp':
            model = DistributedDataParallel(model)
        else:
            self.buckets = GradientBuckets([p for p in model.parameters() if p.requires_grad])
            if name == 'ours-before':
                self.buckets.buckets = _close_before(list(reversed(self.buckets.params)), 25.0, 1.0)
                self.buckets.overlap = len(self.buckets.buckets) > 1
                self.buckets._ready = None
            self.buckets.attach(model)
            reduce, self.waited = self.buckets.reduce, [0.0]

            def timed():
                start = time.perf_counter()
                reduce()
                self.waited[0] += time.perf_counter() - start
            self.buckets.reduce = timed
        self.model, self.name = model, name
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())
        self.batch = (torch.randn(contenders.BATCH, *shape, generator=generator),
                      torch.randint(0, contenders.CLASSES, (contenders.BATCH,), generator=generator))

    def step(self):
        x, y = self.batch
        self.optimizer.zero_grad()
        if self.buckets is not None:
            self.buckets.arm()
            self.waited[0] = 0.0
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.buckets is not None:
            self.buckets.disarm()
        wait = self.waited[0] if self.buckets is not None else 0.0
        self.optimizer.step()
        t3 = time.perf_counter()
        return dict(forward=t1 - t0, backward=t2 - t1 - wait, wait=wait, optimizer=t3 - t2, step=t3 - t0)

    def schedule(self):
        if self.buckets is None:
            return None
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self.buckets.buckets]


def worker(config):
    """Per model, ``steps`` plain steps of each contender per repeat, interleaved; median ms of each phase."""
    torch.set_num_threads(1)
    out = {}
    for model_name in config['models']:
        loops = {name: _Loop(name, model_name) for name in ('ddp', 'ours', 'ours-before')}
        times = {name: {phase: [] for phase in PHASES} for name in loops}
        for loop in loops.values():
            for _ in range(3):
                loop.step()
        for repeat in range(config['repeats']):
            names = list(loops)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                dist.barrier()
                for _ in range(config['steps'][model_name]):
                    for phase, seconds in loops[name].step().items():
                        times[name][phase].append(seconds)
        out[model_name] = {name: dict({phase: 1e3 * statistics.median(v) for phase, v in phases.items()},
                                      schedule=loops[name].schedule()) for name, phases in times.items()}
    return dict(phases=out)
