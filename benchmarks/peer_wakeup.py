"""Does a public torch call on a failing rank wake its gloo peers blocked in a collective? How fast?

Plain torch (no torchbearer_dist): ``world`` ranks over gloo on loopback meet through a TCPStore and
warm up with one all_reduce (so every pair is connected). Then every rank but the failing one (rank 1)
enters a blocking all_reduce that rank 1 never joins. One second later rank 1 performs ``action`` and
stays alive (as a rank does while it publishes its error, or a notebook that caught it). Each blocked
rank reports how long after the action its all_reduce raised, and the first line of the error; a rank
that is still blocked when the process-group timeout ends reports the timeout.

Actions:
    none             control: rank 1 does nothing
    destroy          torch.distributed.destroy_process_group()
    pg-abort         ProcessGroup.abort() on the default group
    pg-shutdown      ProcessGroup.shutdown() on the default group
    abort-destroy    ProcessGroup.abort(), then destroy_process_group()
    exit             os._exit(1): the process dies (the kernel closes its sockets)

``--hold 1`` makes rank 1 keep a pending ``irecv`` (a Work object referencing the group) while it acts,
as a traceback does that references a pending gradient all-reduce; ``--hold 2`` keeps a Work that has
completed. ``--lazy`` sets
``TORCH_GLOO_LAZY_INIT=1`` (pairs connect on first use). ``--peers-abort`` makes each woken rank call
the same action itself, so that the failure travels on to ranks that were waiting on it.

Usage::

    python benchmarks/peer_wakeup.py                      # every action, world 2 and 3, 3 repeats
    python benchmarks/peer_wakeup.py --actions pg-abort --world 3 --repeats 5

Prints one row per run: action, world, hold, lazy, the slowest woken rank's seconds, and its error.
"""
import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from multiprocessing import get_context

ACTIONS = ('none', 'destroy', 'pg-abort', 'pg-shutdown', 'abort-destroy', 'exit')


def _act(action):
    import torch.distributed as dist
    if action == 'destroy':
        dist.destroy_process_group()
    elif action == 'pg-abort':
        dist.distributed_c10d._get_default_group().abort()
    elif action == 'pg-shutdown':
        dist.distributed_c10d._get_default_group().shutdown()
    elif action == 'abort-destroy':
        dist.distributed_c10d._get_default_group().abort()
        dist.destroy_process_group()
    elif action == 'exit':
        os._exit(1)


def _rank(rank, world, port, action, hold, lazy, peers_abort, timeout, queue, local=False):
    os.environ['TORCH_CPP_LOG_LEVEL'] = 'FATAL'
    if lazy:
        os.environ['TORCH_GLOO_LAZY_INIT'] = '1'
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore('127.0.0.1', port, world, rank == 0, timedelta(seconds=30))
    dist.init_process_group('gloo', store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    dist.all_reduce(torch.ones(1))
    if hold == 2 and rank != 1:
        dist.all_reduce(torch.ones(1))  # rank 1's held Work completes
    if local:  # a thread of each blocked rank acts on its own group; rank 1 just stays silent
        if rank == 1:
            time.sleep(timeout + 5)
            os._exit(0)
        import threading

        def act_later():
            time.sleep(1.0)
            store.set('acted', repr(time.time()))
            _act(action)

        threading.Thread(target=act_later, daemon=True).start()
    elif rank == 1:
        pending = None
        if hold == 1:  # a Work still in flight
            pending = dist.irecv(torch.zeros(1), src=0, tag=77)
        elif hold == 2:  # a Work that completed, still referenced
            pending = dist.all_reduce(torch.ones(1), async_op=True)
        time.sleep(1.0)
        store.set('acted', repr(time.time()))
        _act(action)
        time.sleep(timeout + 5)
        del pending
        queue.put((rank, None, 'acted'))
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1))
        queue.put((rank, None, 'completed'))
    except Exception as error:
        now = time.time()
        acted = float(store.get('acted').decode()) if store.check(['acted']) else now
        queue.put((rank, now - acted, '{}: {}'.format(type(error).__name__, str(error).splitlines()[0][:110])))
        if peers_abort:
            try:
                _act(action if action != 'exit' else 'pg-abort')
            except Exception:
                pass
        time.sleep(timeout + 5)  # stay alive: only the measured action may wake the others
    os._exit(0)


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def measure(action, world, hold=False, lazy=False, peers_abort=False, timeout=10.0, local=False):
    """One run; returns (seconds until the last blocked rank raised, or None at the timeout, its error)."""
    context = get_context('spawn')
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(r, world, port, action, hold, lazy, peers_abort, timeout,
                                                     queue, local), daemon=True) for r in range(world)]
    for process in processes:
        process.start()
    reports = {}
    deadline = time.monotonic() + timeout + 30
    try:
        while len(reports) < world - 1 and time.monotonic() < deadline:
            try:
                rank, seconds, text = queue.get(timeout=0.5)
            except Exception:
                continue
            if rank != 1:
                reports[rank] = (seconds, text)
    finally:
        for process in processes:
            process.kill()
            process.join()
    if len(reports) < world - 1:
        return None, 'no report within {:g} s'.format(timeout + 30)
    slowest = max(reports.values(), key=lambda r: -1 if r[0] is None else r[0])
    return slowest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--actions', type=str, default=','.join(ACTIONS))
    parser.add_argument('--world', type=str, default='2,3')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--timeout', type=float, default=10.0, help='process-group timeout, seconds')
    parser.add_argument('--hold', type=str, default='0,1,2',
                        help='comma-separated: 0 nothing, 1 a pending Work, 2 a completed Work held by rank 1')
    parser.add_argument('--lazy', type=str, default='0', help='0, 1 or 0,1: TORCH_GLOO_LAZY_INIT')
    parser.add_argument('--peers-abort', type=int, default=1, help='woken ranks call the same action themselves')
    parser.add_argument('--local', type=int, default=0,
                        help='1: a thread of each blocked rank performs the action on its own group instead')
    args = parser.parse_args(argv)
    import torch
    print('torch {}, gloo on loopback, process-group timeout {:g} s'.format(torch.__version__, args.timeout))
    print('local={} (1: each blocked rank acts on its own group from a thread)'.format(args.local))
    print('action,world,hold,lazy,seconds,error')
    for action in args.actions.split(','):
        for world in map(int, args.world.split(',')):
            for hold in map(int, args.hold.split(',')):
                for lazy in map(int, args.lazy.split(',')):
                    for _ in range(args.repeats):
                        seconds, text = measure(action, world, hold, bool(lazy), bool(args.peers_abort),
                                                args.timeout, bool(args.local))
                        print('{},{},{},{},{},{}'.format(action, world, hold, lazy,
                                                         'timeout' if seconds is None else '{:.3f}'.format(seconds),
                                                         text.replace(',', ';')), flush=True)


if __name__ == '__main__':
    sys.exit(main())
