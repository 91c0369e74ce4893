"""The MNIST example as two machines run it, on two namespace hosts over shaped links: what a user reads.

Usage (as root, from a clone; needs iproute2)::

    python benchmarks/example_two_hosts.py --links 100mbit,1gbit -- --local-steps 32 --epochs 2

Each link: two network namespaces joined by a bridge, each host's sending side shaped by ``tbf``
(benchmarks/netns.py); rank 0 and rank 1 of ``examples/distributed_data_parallel.py`` started in them
as two machines start them (``--world-size 2 --rank i --host ADDR``), one thread each, with the
arguments after ``--``. Prints rank 0's output per link: the epoch lines and the communication report.
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import netns  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(HERE), 'examples', 'distributed_data_parallel.py')
PORT = 29517


def run_link(hosts, link, extra, timeout):
    """Both ranks of the example on ``link``; returns rank 0's stdout and the exit codes."""
    hosts.shape(None if link == 'none' else link)
    with tempfile.TemporaryDirectory() as scratch:
        ranks = []
        for rank in (0, 1):
            argv = [sys.executable, EXAMPLE, '--download', 'never', '--world-size', '2', '--rank', str(rank),
                    '--host', hosts.address(0), '--port', str(PORT), '--threads', '1',
                    '--save', os.path.join(scratch, 'model{}.pt'.format(rank)), *extra]
            ranks.append(subprocess.Popen(hosts.command(rank, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, cwd=scratch))
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    return outputs[0][0], [rank.returncode for rank in ranks], outputs[0][1] + outputs[1][1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index('--') + 1:] if '--' in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     epilog="after '--', the example's own flags, e.g. -- --local-steps 32 --epochs 2")
    parser.add_argument('--links', type=str, default='100mbit,1gbit', help='tc rates, comma-separated (none: unshaped)')
    parser.add_argument('--timeout', type=float, default=600.0, help='seconds a link\'s run may take')
    args = parser.parse_args(argv[:argv.index('--')] if '--' in argv else argv)
    reason = netns.unavailable()
    if reason:
        print('skipped: {}'.format(reason))
        return 0
    with netns.Hosts(2) as hosts:
        for link in args.links.split(','):
            out, codes, err = run_link(hosts, link, extra, args.timeout)
            print('== link {}, example {} (exit codes {})'.format(link, ' '.join(extra), codes))
            print(out.strip())
            if any(codes):
                print(err[-3000:])
    return 0


if __name__ == '__main__':
    sys.exit(main())
