"""The cost of CommunicationReport, on by default in ``distributed_callbacks()``.

Usage::

    python benchmarks/comm_report_cost.py                # 2 ranks, 7 interleaved repeats of the example's 5 epochs
    python benchmarks/comm_report_cost.py --quick        # a smoke run
    python benchmarks/comm_report_cost.py --link 100mbit --compression none,powersgd   # the report on a slow link

The MNIST example (its 784-100-10 perceptron, 4,000 digits, batch 32 per rank, SGD with momentum,
from ``example_parts.py``) trained by a Trial with :func:`torchbearer_dist.distributed_callbacks`, 2
ranks on gloo, one thread per rank, ``report=True`` and ``report=False`` in turn (the order swapped
every repeat); figures are medians over repeats, on the rank where the report weighs most.

Three figures, from the loosest to the most direct:

- ``on/off``: the median over repeats of the ratio of the two runs' wall times within a repeat, less
  one, and the same for the rank's CPU time (``cpu``). On a shared machine these are mostly noise:
  repeats of one setting spread by more than the report costs.
- ``report``: the seconds spent in the report's own hooks (its per-step count, its epoch-end
  all-reduce of ``6 x world_size`` numbers, its line), timed inside the run; the epoch-end hook is
  timed after an untimed barrier, so that waiting for a later rank, which the next collective would
  wait for anyway, is not counted.
- ``counters``: the engine's counters, which run whether the report is on or not (three
  ``time.perf_counter`` calls and four additions per step with one bucket), timed in a loop of a
  million and multiplied by the steps.

With ``--link RATE`` it measures nothing: it trains the same Trial for ``--epochs`` on two hosts made
of network namespaces (``netns.py``, needs root) whose links are shaped to ``RATE`` with tbf, once
per ``--compression``, and shows the lines the report prints on rank 0.
"""
import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torchbearer
from example_parts import Net, load_mnist_5k_flat
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import torchbearer_dist
from torchbearer_dist.callbacks.comm_report import CommunicationReport

BATCH = 32


class _Clock:
    """Seconds spent in the report's hooks of this process."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, name, barrier=False):
        original = getattr(CommunicationReport, name)
        clock = self

        def timed(report, state):
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            try:
                return original(report, state)
            finally:
                clock.seconds += time.perf_counter() - start

        setattr(CommunicationReport, name, timed)


def _run(dataset, report, epochs, clock, compression=None, quiet=True):
    torch.manual_seed(0)
    model = Net()
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'], verbose=0,
                              callbacks=torchbearer_dist.distributed_callbacks(report=report, compression=compression))
    trial.with_train_generator(loader)
    before = clock.seconds
    cpu, start = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():  # the report's lines
        history = trial.run(epochs)
    return time.perf_counter() - start, clock.seconds - before, time.process_time() - cpu, history


def _counter_seconds(loops=1000000):
    """One step's counters with one bucket: perf_counter at the first send, around the wait, and the sums."""
    sent, waited, flight = 0, 0.0, 0.0
    start = time.perf_counter()
    for _ in range(loops):
        sent_at = time.perf_counter()
        sent += 318040
        begin = time.perf_counter()
        waited_at = time.perf_counter()
        waited += waited_at - begin
        flight += waited_at - sent_at
    return (time.perf_counter() - start) / loops


def _worker(repeats, epochs):
    torch.set_num_threads(1)
    clock = _Clock()
    for name in ('on_start_training', 'on_step_training', 'on_end_training'):
        clock.wrap(name)
    clock.wrap('on_end_epoch', barrier=True)
    dataset = load_mnist_5k_flat()[0]
    _run(dataset, True, 1, clock)  # warm-up
    runs = {True: [], False: []}
    for repeat in range(repeats):
        for report in ((True, False) if repeat % 2 == 0 else (False, True)):
            runs[report].append(_run(dataset, report, epochs, clock))
    steps = len(DataLoader(range(len(dataset) // dist.get_world_size()), batch_size=BATCH))
    return {'runs': {k: [r[:3] for r in v] for k, v in runs.items()}, 'steps': steps,
            'counters': _counter_seconds(), 'last': runs[True][-1][3][-1]}


def _host_worker(rank, master, port, compression, epochs):
    """One host of ``--link``: join the job, train, and let the report print (rank 0)."""
    torch.set_num_threads(1)
    with torchbearer_dist.process_group(rank=rank, world_size=2, host=master, port=port, timeout=300):
        _run(load_mnist_5k_flat()[0], True, epochs, _Clock(), None if compression == 'none' else compression,
             quiet=False)


def _on_link(rate, compressions, epochs):
    import netns
    reason = netns.unavailable()
    if reason:
        sys.exit('error: --link needs network namespaces, but {}'.format(reason))
    with netns.Hosts(2) as hosts:
        hosts.shape(rate)
        for port, compression in enumerate(compressions, 29600):
            print('{} on two hosts at {}, the example\'s model, {} epoch(s):'.format(compression, rate, epochs),
                  flush=True)
            env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.path.dirname(os.path.dirname(
                os.path.abspath(__file__))))
            ranks = [subprocess.Popen(hosts.command(rank, [
                sys.executable, os.path.abspath(__file__), '--host-worker', str(rank), hosts.address(0), str(port),
                compression, str(epochs)]), env=env) for rank in range(2)]
            if any(process.wait(timeout=600) for process in ranks):
                sys.exit('error: a host failed with {} on {}'.format(compression, rate))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, default=2, help='processes')
    parser.add_argument('--repeats', type=int, default=7, help='runs with the report on, and as many off')
    parser.add_argument('--epochs', type=int, help='epochs per run (default: 5, as the example; 1 with --link)')
    parser.add_argument('--quick', action='store_true', help='one repeat of one epoch')
    parser.add_argument('--link', type=str, help='show the report on two namespace hosts at this tc rate, '
                        'e.g. 100mbit (needs root); measures nothing')
    parser.add_argument('--compression', type=str, default='none',
                        help='with --link: comma-separated compressions to run in turn (none, fp16, powersgd)')
    parser.add_argument('--host-worker', type=str, nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.host_worker:
        rank, master, port, compression, epochs = args.host_worker
        return _host_worker(int(rank), master, int(port), compression, int(epochs))
    if args.link:
        return _on_link(args.link, args.compression.split(','), args.epochs or 1)
    repeats, epochs = (1, 1) if args.quick else (args.repeats, args.epochs or 5)
    per_rank = torchbearer_dist.launch(_worker, args.ranks, args=(repeats, epochs), timeout=120)
    print('{} ranks, gloo, 1 thread per rank, the MNIST example (batch {} per rank), {} epoch(s) per run, {} runs '
          'each way, medians'.format(args.ranks, BATCH, epochs, repeats))
    print('{:>4} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>13} {:>8}'.format(
        'rank', 'run on', 'run off', 'on/off', 'cpu', 'report', 'share', 'counters/step', 'share'))
    for rank, results in enumerate(per_rank):
        runs = results['runs']
        on = statistics.median(r[0] for r in runs[True])
        off = statistics.median(r[0] for r in runs[False])
        wall = statistics.median(a[0] / b[0] for a, b in zip(runs[True], runs[False])) - 1
        cpu = statistics.median(a[2] / b[2] for a, b in zip(runs[True], runs[False])) - 1
        own = statistics.median(r[1] for r in runs[True])
        counters = results['counters'] * results['steps'] * epochs
        print('{:>4} {:>7.3f}s {:>7.3f}s {:>+7.2f}% {:>+7.2f}% {:>7.2f}ms {:>6.3f}% {:>11.3f}us {:>7.4f}%'.format(
            rank, on, off, 100 * wall, 100 * cpu, own * 1e3, 100 * own / on, results['counters'] * 1e6,
            100 * counters / on))
    last = per_rank[0]['last']
    print('last epoch of the last run with the report:', {k: last[k] for k in sorted(last) if k in (
        'comm_bytes', 'comm_wait_s', 'comm_mbit_s', 'train_s', 'slowest_rank', 'slowest_lag_s')})


if __name__ == '__main__':
    main()
