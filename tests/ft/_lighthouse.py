"""A lighthouse in a process of its own, for the tests that lose it or restart it on the same address.

``python _lighthouse.py --bind HOST:PORT [--wait FILE]``: with ``--wait``, imports first, prints ``WAITING``
and binds once ``FILE`` exists (a restart without the import's seconds); prints ``LISTENING`` once it serves,
and serves until killed.
"""
import argparse
import os
import threading
import time

from torchbearer_dist.ft import Lighthouse


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--bind', type=str, required=True)
    parser.add_argument('--wait', type=str, help='a file to wait for before binding')
    parser.add_argument('--min-replicas', type=int, default=1)
    parser.add_argument('--join-timeout', type=float, default=15.0)
    parser.add_argument('--heartbeat-timeout', type=float, default=2.0)
    args = parser.parse_args()
    if args.wait:
        print('WAITING', flush=True)
        while not os.path.exists(args.wait):
            time.sleep(0.01)
    server = Lighthouse(args.bind, args.min_replicas, args.join_timeout, args.heartbeat_timeout)
    print('LISTENING', flush=True)
    threading.Event().wait()
    server.shutdown()


if __name__ == '__main__':
    main()
