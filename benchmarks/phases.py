"""Where a data-parallel step spends its time: forward, backward, wait after backward, optimizer step.

A plain training loop (no Trial) per rank, run by ``python benchmarks/multihost.py --phases`` in the
namespace hosts. Contenders, interleaved: torch DDP, and our bucket engine
(:class:`~torchbearer_dist.buckets.GradientBuckets`) as configured by default. "wait" is the time
from the end of ``loss.backward()`` until every gradient is averaged (DDP finishes inside backward,
so its wait is 0 and its backward includes communication).
"""
import statistics
import time

import contenders
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchbearer_dist.buckets import GradientBuckets

PHASES = ('forward', 'backward', 'wait', 'optimizer', 'step')


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
            self.buckets.attach()
        self.model, self.name = model, name
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())
        self.batch = (torch.randn(contenders.BATCH, *shape, generator=generator),
                      torch.randint(0, contenders.CLASSES, (contenders.BATCH,), generator=generator))

    def step(self):
        x, y = self.batch
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.buckets is not None and getattr(self.buckets, 'pending_finish', True):
            self.buckets.finish()
        t3 = time.perf_counter()
        self.optimizer.step()
        t4 = time.perf_counter()
        return dict(forward=t1 - t0, backward=t2 - t1, wait=t3 - t2, optimizer=t4 - t3, step=t4 - t0)

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
        loops = {name: _Loop(name, model_name) for name in ('ddp', 'ours')}
        times = {name: {phase: [] for phase in PHASES} for name in loops}
        for loop in loops.values():
            for _ in range(3):
                loop.step()
        for repeat in range(config['repeats']):
            for name in (list(loops) if repeat % 2 == 0 else list(reversed(list(loops)))):
                dist.barrier()
                for _ in range(config['steps'][model_name]):
                    for phase, seconds in loops[name].step().items():
                        times[name][phase].append(seconds)
        out[model_name] = {name: dict({phase: 1e3 * statistics.median(v) for phase, v in phases.items()},
                                      schedule=loops[name].schedule()) for name, phases in times.items()}
    return dict(phases=out)
