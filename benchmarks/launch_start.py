"""How long :func:`torchbearer_dist.launch` takes for a trivial job, spawned or forked from a forkserver.

Each launch runs one all_reduce on ``--world`` ranks over gloo on loopback and returns; the time is
the whole call, from starting the ranks to their results, as a program that launches many jobs (a
sweep, a test suite) pays it per job. The start methods are interleaved, repeat by repeat, so that
the machine's load hits both alike. The forkserver's first launch also starts the server, which
imports this module and so torch: it is reported apart from the later ones.

Usage::

    python benchmarks/launch_start.py                 # 2 ranks, 7 repeats
    python benchmarks/launch_start.py --world 3 --repeats 11

Prints each method's median seconds per launch, the forkserver's first launch, and the ratio of the
medians.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torchbearer_dist


def _job():
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--world', type=int, default=2, help='ranks per launch')
    parser.add_argument('--repeats', type=int, default=7, help='timed launches per start method')
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = {'spawn': [], 'forkserver': []}
    started = time.monotonic()
    torchbearer_dist.launch(_job, args.world, start_method='forkserver')  # starts the server
    first = time.monotonic() - started
    for _ in range(args.repeats):
        for method in seconds:
            started = time.monotonic()
            assert torchbearer_dist.launch(_job, args.world, start_method=method) == [float(args.world)] * args.world
            seconds[method].append(time.monotonic() - started)
    spawn, served = statistics.median(seconds['spawn']), statistics.median(seconds['forkserver'])
    print('world {}, {} repeats, medians of seconds per launch:'.format(args.world, args.repeats))
    print('  spawn       {:.2f} s  (all: {})'.format(spawn, ' '.join('{:.2f}'.format(s) for s in seconds['spawn'])))
    print('  forkserver  {:.2f} s  (all: {}); its first launch, starting the server: {:.2f} s'.format(
        served, ' '.join('{:.2f}'.format(s) for s in seconds['forkserver']), first))
    print('  spawn / forkserver: {:.1f}x'.format(spawn / served))


if __name__ == '__main__':
    main()
