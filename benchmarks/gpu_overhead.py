"""What a torchbearer Trial with ``distributed_callbacks()`` costs against a plain PyTorch loop, in a job of one.

Usage::

    python benchmarks/gpu_overhead.py                                  # CUDA if present: nccl; 5 repeats
    python benchmarks/gpu_overhead.py --device cpu --steps 5 --repeats 2   # a smoke run (gloo)
    python benchmarks/gpu_overhead.py --json out.json --profile prof.txt

One process inside a real process group of one (``torchbearer_dist.process_group``: nccl on CUDA,
gloo on CPU) trains each model three ways on the same batches, already in the device's memory: a
plain loop (``zero_grad``, forward, cross-entropy, ``backward``, ``step``), a bare torchbearer Trial
(no metrics, ``verbose=0``, no callback of ours: torchbearer's own cost) and the same Trial with
:func:`torchbearer_dist.distributed_callbacks` (ours on top). Each way has its own model and SGD
optimizer, built from the same seed. After one untimed warm-up run each, every repeat runs all three,
each first in turn, ``--steps`` steps each; the clocks are read after
``torch.cuda.synchronize()`` (the Trial's from a callback at ``on_start_training`` and
``on_end_training``, so building the Trial and ``run()``'s set-up are not counted). Figures are
medians over repeats of steps per second; the ratios are the Trial-with-ours' over the plain loop's
and over the bare Trial's, each the median of the ratios within a repeat (1.0: no cost; below 1:
slower). The models: the example's 784-100-10 perceptron on flat 784-value inputs
(``example_parts.Net``) and torchvision's ResNet-18 (10 classes) on 3x32x32 inputs, both at
``--batch-size`` (256; 32 on CPU, where a run is only a smoke check). The data are random: only
speed is measured.

With ``--profile FILE``, a model whose Trial is more than ``--slower`` (3 %) slower than the plain
loop gets torch.profiler's table of the Trial's run (top 25 by self CPU time) written to FILE.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torchbearer
from example_parts import Net
from torch import nn

import torchbearer_dist

MODELS = ('mlp', 'resnet18')
#: Distinct batches in device memory; the runs cycle through them.
POOL = 4
LR = 0.01


def _model(name, seed=0):
    torch.manual_seed(seed)
    if name == 'mlp':
        return Net()
    import torchvision
    return torchvision.models.resnet18(num_classes=10)


def _batches(name, batch_size, steps, device):
    """``steps`` batches (references to :data:`POOL` distinct ones) on ``device``."""
    generator = torch.Generator().manual_seed(1)
    shape = (batch_size, 784) if name == 'mlp' else (batch_size, 3, 32, 32)
    pool = [(torch.randn(*shape, generator=generator).to(device),
             torch.randint(0, 10, (batch_size,), generator=generator).to(device)) for _ in range(POOL)]
    return [pool[i % POOL] for i in range(steps)]


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


class _Clock(torchbearer.callbacks.Callback):
    """Reads the clock, after a synchronize, when the training loop of an epoch starts and ends."""

    def __init__(self, device):
        super().__init__()
        self.device, self.start, self.end = device, None, None

    def on_start_training(self, state):
        _sync(self.device)
        self.start = time.perf_counter()

    def on_end_training(self, state):
        _sync(self.device)
        self.end = time.perf_counter()


class _Plain:
    """The plain PyTorch loop: its own model and optimizer, kept across runs."""

    def __init__(self, name, device):
        self.device = device
        self.model = _model(name).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def run(self, batches):
        """Seconds for ``len(batches)`` steps."""
        model, optimizer = self.model, self.optimizer
        model.train()
        _sync(self.device)
        start = time.perf_counter()
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        _sync(self.device)
        return time.perf_counter() - start


class _TrialRun:
    """A torchbearer Trial, with distributed_callbacks() or (``ours=False``) without: its own model and
    optimizer, a new Trial each run."""

    def __init__(self, name, device, ours=True):
        self.device, self.ours = device, ours
        self.model = _model(name).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def trial(self, batches):
        clock = _Clock(self.device)
        trial = torchbearer.Trial(self.model, self.optimizer, nn.CrossEntropyLoss(), metrics=[],
                                  callbacks=[clock, *(torchbearer_dist.distributed_callbacks() if self.ours else [])],
                                  verbose=0)
        return trial.to(self.device).with_train_generator(batches), clock

    def run(self, batches):
        """Seconds for ``len(batches)`` steps, from the first batch to the end of the last."""
        trial, clock = self.trial(batches)
        trial.run(1)
        return clock.end - clock.start


def _measure(name, device, steps, repeats, batch_size):
    batches = _batches(name, batch_size, steps, device)
    runners = {'plain': _Plain(name, device), 'bare': _TrialRun(name, device, ours=False),
               'trial': _TrialRun(name, device)}
    warm = batches[:min(steps, 20)]
    for runner in runners.values():  # cuDNN's choices, the caching allocator, the first kernels: untimed
        runner.run(warm)
    seconds = {way: [] for way in runners}
    order = list(runners)
    for repeat in range(repeats):
        for way in order[repeat % 3:] + order[:repeat % 3]:  # each way first in turn
            seconds[way].append(runners[way].run(batches))
    rates = {way: [steps / s for s in values] for way, values in seconds.items()}
    median = {way: statistics.median(values) for way, values in rates.items()}
    return {'model': name, 'plain_steps_per_s': median['plain'], 'bare_trial_steps_per_s': median['bare'],
            'trial_steps_per_s': median['trial'], 'ratio': median['trial'] / median['plain'],
            'ratio_within_repeats': statistics.median(t / p for t, p in zip(rates['trial'], rates['plain'])),
            'ratio_to_bare_within_repeats': statistics.median(t / b for t, b in zip(rates['trial'], rates['bare'])),
            'plain_all': rates['plain'], 'bare_all': rates['bare'], 'trial_all': rates['trial'],
            'trial_runner': runners['trial'], 'batches': batches}


def _profile(result, device, steps):
    """torch.profiler's table of one Trial run of ``steps`` steps, top 25 by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    trial, _ = result['trial_runner'].trial(result['batches'][:steps])
    with profile(activities=activities) as prof:
        trial.run(1)
        _sync(device)
    return prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25)


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device', type=str, default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cuda (nccl) or cpu (gloo); default cuda where available')
    parser.add_argument('--steps', type=int, default=200, help='steps per timed run')
    parser.add_argument('--repeats', type=int, default=5, help='timed runs of each way, interleaved')
    parser.add_argument('--batch-size', type=int, default=None,
                        help='samples per step (default 256 on CUDA; 32 on CPU, where a run is a smoke check)')
    parser.add_argument('--models', type=str, default=','.join(MODELS), help='comma-separated: mlp, resnet18')
    parser.add_argument('--threads', type=int, default=None, help="CPU threads (default: torch's own choice)")
    parser.add_argument('--json', type=str, default=None, help='write the figures to this JSON file')
    parser.add_argument('--profile', type=str, default=None,
                        help='write the profiler table of each model whose Trial is slower than --slower here')
    parser.add_argument('--slower', type=float, default=0.03, help='the slowdown that triggers --profile')
    parser.add_argument('--profile-steps', type=int, default=50, help='steps of the profiled Trial run')
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(',') if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error('--models should be among {}, but given {}'.format(', '.join(MODELS), ', '.join(unknown)))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            parser.error('--device {} needs CUDA, and this machine has none; pass --device cpu'.format(args.device))
        device = torch.device('cuda', torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    if args.batch_size is None:
        args.batch_size = 256 if device.type == 'cuda' else 32

    results, profiles = [], []
    with torchbearer_dist.process_group(rank=0, world_size=1, host='127.0.0.1', port=_free_port(), backend=backend,
                                        timeout=300):
        for name in models:
            result = _measure(name, device, args.steps, args.repeats, args.batch_size)
            if args.profile and result['ratio'] < 1 - args.slower:
                profiles.append('== {}: Trial at {:.3f}x the plain loop; {} steps profiled ==\n{}\n'.format(
                    name, result['ratio'], min(args.profile_steps, args.steps),
                    _profile(result, device, min(args.profile_steps, args.steps))))
            del result['trial_runner'], result['batches']
            results.append(result)
            print('{}: plain {:.1f} steps/s, Trial {:.1f} steps/s'.format(
                name, result['plain_steps_per_s'], result['trial_steps_per_s']), file=sys.stderr, flush=True)

    report = {'device': torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu',
              'backend': backend, 'torch': torch.__version__, 'torchbearer': torchbearer.__version__,
              'batch_size': args.batch_size, 'steps': args.steps, 'repeats': args.repeats,
              'cpu_threads': torch.get_num_threads(), 'load_average': os.getloadavg()[0], 'results': results}
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(report, f, indent=1)
    if args.profile and profiles:
        with open(args.profile, 'w') as f:
            f.write(''.join(profiles))
    print('{} ({}), batch {}, {} steps per run, median of {} interleaved repeats{}'.format(
        report['device'], backend, args.batch_size, args.steps, args.repeats,
        '; profiled: {}'.format(args.profile) if profiles else ''))
    print('{:10} {:>14} {:>17} {:>14} {:>10} {:>10}'.format(
        'model', 'plain steps/s', 'bare Trial steps/s', 'Trial steps/s', 'to plain', 'to bare'))
    for r in results:  # the ratios: the Trial with distributed_callbacks() over each other way, within repeats
        print('{:10} {:>14.1f} {:>17.1f} {:>14.1f} {:>10.3f} {:>10.3f}'.format(
            r['model'], r['plain_steps_per_s'], r['bare_trial_steps_per_s'], r['trial_steps_per_s'],
            r['ratio_within_repeats'], r['ratio_to_bare_within_repeats']))
    return report


if __name__ == '__main__':
    main()
