"""The models and the contenders of the benchmark, and the worker that runs them side by side on each rank.

Every contender trains a torchbearer Trial on pre-built random batches held in memory, so that the
numbers measure the training step and gradient synchronization, not data loading.
"""
import re
import resource
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback, Trial

from torchbearer_dist import AllReduceGradients, BroadcastParameters
from torchbearer_dist.sync.powersgd import PowerSGD

BATCH = 64
CLASSES = 10


def mlp():
    """The 784-100-10 MLP of torchbearer's distributed example: 4 parameter tensors, 79,510 values."""
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, CLASSES))


def cnn():
    """A small CNN on 1x28x28: two 5x5 convolutions, then 512-128-10; 8 tensors, 80,202 values."""
    return nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def mlp64():
    """An MLP of 32 narrow Linear layers: 64 parameter tensors, 57,130 values."""
    layers = [nn.Linear(784, 32), nn.ReLU()]
    for _ in range(30):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    layers.append(nn.Linear(32, CLASSES))
    return nn.Sequential(*layers)


def cnn1m():
    """PyTorch's MNIST example CNN: 3x3 convolutions 1->32->64, max-pool 2, then 9216-128-10; 1,199,882 values."""
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, CLASSES))


MODELS = {'mlp': (mlp, (784,)), 'cnn': (cnn, (1, 28, 28)), 'mlp64': (mlp64, (784,)), 'cnn1m': (cnn1m, (1, 28, 28))}
#: Rank and warm-up of every PowerSGD contender, ours and torch's hook alike.
POWERSGD_RANK, POWERSGD_START = 4, 2


class PerParameterAllReduce(Callback):
    """The torchbearer note's recipe: one blocking all-reduce per parameter after backward."""

    def on_backward(self, state):
        world_size = dist.get_world_size()
        for p in state[torchbearer.MODEL].parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size


class PowerSGDGradients(Callback):
    """Our :class:`~torchbearer_dist.sync.powersgd.PowerSGD` averaging gradients in ``on_backward``."""

    def __init__(self, start_iter=POWERSGD_START):
        super().__init__()
        self.powersgd, self.start_iter = None, start_iter

    def on_start(self, state):
        if self.powersgd is None:
            self.powersgd = PowerSGD([p for p in state[torchbearer.MODEL].parameters() if p.requires_grad],
                                     matrix_approximation_rank=POWERSGD_RANK, start_iter=self.start_iter)

    def on_backward(self, state):
        self.powersgd.reduce()


def _powersgd_callbacks():
    try:
        return [BroadcastParameters(), AllReduceGradients(compression='powersgd', powersgd_rank=POWERSGD_RANK,
                                                          powersgd_start_iter=POWERSGD_START)]
    except (TypeError, ValueError):  # a version of AllReduceGradients without PowerSGD: the same algorithm
        return [BroadcastParameters(), PowerSGDGradients()]


def register_hook(model, hook):
    """Register torch's fp16 or PowerSGD DDP communication hook on a DistributedDataParallel ``model``."""
    if hook == 'fp16':
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == 'powersgd':
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=POWERSGD_START)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


class AccumulateSteps:
    """Gradient accumulation in a Trial: step and zero the optimizer only on every ``every``-th step."""

    def __init__(self, optimizer, every):
        self.optimizer, self.every, self.calls = optimizer, every, 0

    def zero_grad(self, set_to_none=True):
        pass  # the Trial's closure calls this every step; gradients accumulate until the real step

    def step(self, closure):
        loss = closure()
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss

    def state_dict(self):
        return self.optimizer.state_dict()


#: ranks=0 means every rank of the job trains.
#: name -> (how many ranks train, batch per rank, threads, what wraps the model, callbacks factory, note)
CONTENDERS = {
    'single-1-thread': dict(ranks=1, batch=BATCH, threads=1, note='one process, 1 thread, batch 64'),
    'single-all-cores': dict(ranks=1, batch=2 * BATCH, threads=2, note='one process, 2 threads, batch 128'),
    'ddp': dict(ranks=0, ddp=True, note='DistributedDataParallel (25 MB buckets, 1 MB first) in a Trial'),
    'ddp-fp16-hook': dict(ranks=0, ddp=True, hook='fp16', note="DDP with torch's fp16_compress_hook"),
    'ddp-powersgd-hook': dict(ranks=0, ddp=True, hook='powersgd',
                              note="DDP with torch's powerSGD_hook, rank {}, compressing from step {}, "
                                   "one bucket".format(POWERSGD_RANK, POWERSGD_START + 1)),
    'per-param-recipe': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), PerParameterAllReduce()],
                             note="torchbearer note's per-parameter all_reduce in on_backward"),
    'ours': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), AllReduceGradients()],
                 note='AllReduceGradients() defaults'),
    'ours-overlap': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), AllReduceGradients(overlap=True)],
                         note='overlap=True: bucket all-reduces start from autograd hooks during backward'),
    'ours-small-buckets': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), AllReduceGradients(
        overlap=True, bucket_cap_mb=0.0625, first_bucket_mb=0.0625)], note='overlap=True, 64 KiB buckets'),
    'ours-sync-every-2': dict(ranks=0, accumulate=2, callbacks=lambda: [BroadcastParameters(), AllReduceGradients(
        sync_every=2)], note='sync_every=2 with an optimizer that steps every 2nd batch (gradient accumulation)'),
    'ours-fp16': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), AllReduceGradients(compression='fp16')],
                      note="compression='fp16'"),
    'ours-bf16': dict(ranks=0, callbacks=lambda: [BroadcastParameters(), AllReduceGradients(compression='bf16')],
                      note="compression='bf16'"),
    'ours-powersgd': dict(ranks=0, callbacks=_powersgd_callbacks,
                          note="compression='powersgd', rank {}, compressing from step {}".format(
                              POWERSGD_RANK, POWERSGD_START + 1)),
}
#: The contenders of the multi-host run (python benchmarks/multihost.py).
MULTIHOST = ['single-1-thread', 'single-all-cores', 'ddp', 'ddp-fp16-hook', 'ddp-powersgd-hook', 'per-param-recipe',
             'ours', 'ours-fp16', 'ours-bf16', 'ours-powersgd']


def _reset_peak_rss():
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) so ru_maxrss measures from now on; False if not possible."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _Runner:
    """One contender on one model: its own replica, optimizer and Trial, reused across repeats."""

    def __init__(self, name, spec, model_name, steps, seed=0):
        self.name, self.spec = name, spec
        build, shape = MODELS[model_name]
        torch.manual_seed(seed)
        model = build()
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())
        batch = spec.get('batch', BATCH)
        batches = [(torch.randn(batch, *shape, generator=generator),
                    torch.randint(0, CLASSES, (batch,), generator=generator)) for _ in range(8)]
        self.batches = [batches[i % len(batches)] for i in range(steps)]
        self.active = spec['ranks'] != 1 or dist.get_rank() == 0
        if spec.get('ddp'):
            # torch's PowerSGD hook issues its second and third all-reduce from the future callbacks of the first;
            # with two DDP buckets those raced the next bucket's all-reduce into a collective mismatch (gloo abort)
            # on this loaded machine, so it gets one bucket: every collective in one chain, in one order.
            model = DistributedDataParallel(model, bucket_cap_mb=25 if spec.get('hook') == 'powersgd' else None)
            register_hook(model, spec.get('hook'))
        self.model = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if spec.get('accumulate'):
            optimizer = AccumulateSteps(optimizer, spec['accumulate'])
        callbacks = spec['callbacks']() if 'callbacks' in spec else []
        self.trial = None
        if self.active:
            self.trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=[], callbacks=callbacks, verbose=0)
            self.trial.with_train_generator(self.batches)

    def run(self):
        """Train one epoch of ``steps`` steps; return (seconds, CPU seconds, peak RSS MiB), None each if idle."""
        dist.barrier()
        if not self.active:
            dist.barrier()
            return None, None, None
        torch.set_num_threads(self.spec.get('threads', 1))
        _reset_peak_rss()
        cpu = time.process_time()
        start = time.perf_counter()
        self.trial.run(epochs=len(self.trial.state[torchbearer.HISTORY]) + 1)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        rss = _peak_rss_mib()
        torch.set_num_threads(1)
        dist.barrier()
        return elapsed, cpu, rss


def time_fused_all_reduce(numel, calls):
    """Median seconds of one blocking all-reduce of a flat fp32 tensor of ``numel`` values (both ranks)."""
    flat = torch.ones(numel)
    dist.all_reduce(flat)
    times = []
    dist.barrier()
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_phases(model_name, steps):
    """Median phases of a plain single-process step (batch 64, 1 thread), and when each gradient is ready.

    Returns:
        tuple: seconds of ``forward``, ``backward`` and ``optimizer``; and per parameter, in registration
        order, the median seconds from the start of backward to its gradient being accumulated
    """
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(BATCH, *shape), torch.randint(0, CLASSES, (BATCH,))
    phases = {'forward': [], 'backward': [], 'optimizer': []}
    params = list(model.parameters())
    ready, started = [[] for _ in params], [0.0]

    def hook(position):
        return lambda p: ready[position].append(time.perf_counter() - started[0])

    handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]
    for step in range(steps + 3):
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = started[0] = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step >= 3:
            phases['forward'].append(t1 - t0)
            phases['backward'].append(t2 - t1)
            phases['optimizer'].append(t3 - t2)
        else:
            for times in ready:
                times.clear()
    for handle in handles:
        handle.remove()
    return {k: statistics.median(v) for k, v in phases.items()}, [statistics.median(t) for t in ready]


def _engine(runner):
    for callback in runner.trial.state[torchbearer.CALLBACK_LIST].callback_list:
        buckets = getattr(callback, 'buckets', None)
        if buckets is not None:
            return buckets
    return None


def bucket_schedule(runner):
    """Sizes in values of the buckets our default callback built, in the order they are sent."""
    buckets = _engine(runner)
    return [b.numel for b in buckets.buckets] if buckets is not None else []


def bucket_members(runner):
    """Per bucket, in sending order, the registration positions of its parameters; and whether hooks overlap."""
    buckets = _engine(runner)
    if buckets is None:
        return [], False
    position = {id(p): i for i, p in enumerate(runner.model.parameters())}
    return [[position[id(p)] for p in b.params] for b in buckets.buckets], bool(buckets.overlap)


def wire_bytes(device):
    """Bytes sent on ``device``: its root qdisc's counter (``tc -s qdisc``), else the link's; None without one."""
    if not device:
        return None
    shown = subprocess.run(['tc', '-s', 'qdisc', 'show', 'dev', device], capture_output=True, text=True).stdout
    match = re.search(r'qdisc (\S+) .*?Sent (\d+) bytes', shown, re.S)
    if match and match.group(1) != 'noqueue':
        return int(match.group(2))
    with open('/sys/class/net/{}/statistics/tx_bytes'.format(device)) as f:
        return int(f.read())


def worker(config):
    """Run every contender on every model, repeats interleaved with the order rotated; return raw records."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    records, extras = [], {}
    names = [n for n in CONTENDERS if n in config['contenders']]
    for model_name in config['models']:
        steps = config['steps'][model_name]
        runners = {name: _Runner(name, CONTENDERS[name], model_name, steps) for name in names}
        for runner in runners.values():  # warm-up: one discarded epoch each
            runner.run()
        numel = sum(p.numel() for p in MODELS[model_name][0]().parameters())
        for repeat in range(config['repeats']):
            shift = repeat % (len(names) + 1)
            order = (names + ['fused-all-reduce'])[shift:] + (names + ['fused-all-reduce'])[:shift]
            for name in order:
                if name == 'fused-all-reduce':
                    seconds = time_fused_all_reduce(numel, config['all_reduce_calls'])
                    records.append(dict(model=model_name, contender=name, repeat=repeat, rank=rank,
                                        seconds=seconds, cpu=None, rss_mib=None))
                    continue
                sent = wire_bytes(config.get('wire_device'))
                seconds, cpu, rss = runners[name].run()
                sent = None if sent is None else wire_bytes(config.get('wire_device')) - sent
                records.append(dict(model=model_name, contender=name, repeat=repeat, rank=rank, seconds=seconds,
                                    cpu=cpu, rss_mib=rss, sent_bytes=sent))
        dist.barrier()
        info = dict(numel=numel, tensors=len(list(MODELS[model_name][0]().parameters())))
        if rank == 0:
            info['phases'], info['ready'] = time_phases(model_name, config['phase_steps'])
            info['sizes'] = [p.numel() for p in MODELS[model_name][0]().parameters()]
            info['shapes'] = [tuple(p.shape) for p in MODELS[model_name][0]().parameters()]
            if 'ours' in runners:
                info['buckets'] = bucket_schedule(runners['ours'])
                info['members'], info['overlap'] = bucket_members(runners['ours'])
            if 'ours-overlap' in runners:
                info['buckets_overlap'] = bucket_schedule(runners['ours-overlap'])
        dist.barrier()
        extras[model_name] = info
        del runners
    return dict(records=records, extras=extras, rss_reset=_reset_peak_rss())
