"""The hand-started rank of the fault tests: a small Trial with the package's callbacks and an injected fault.

Run as a script, one process per rank, as a user starts one rank per machine
(``python tests/runtime/_fault_rank.py --rank i ...``, see :func:`main`); torch is imported only in
:func:`main`, after ``TORCH_CPP_LOG_LEVEL`` is set. The tests that start it are ``test_faults.py``,
``test_interrupts.py``, ``test_rendezvous_faults.py`` and ``test_group_safety.py``; their shared
helpers are in ``_faults.py``.
"""
import argparse
import faulthandler
import os
import signal
import sys
import time

#: Collective timeout of the hand-started ranks, seconds: long, so that only the heartbeat and the
#: published causes can end a faulty job fast.
TIMEOUT = 60
#: Their rendezvous timeout, seconds: also how long a silent peer may go without a heartbeat.
RENDEZVOUS_TIMEOUT = 5
#: This file: the program the tests start.
HERE = os.path.abspath(__file__)


def _build_trial(args):
    import torch
    import torchbearer
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchbearer import Callback, Trial

    import torchbearer_dist as tbd

    class Fault(Callback):
        """Inject ``args.fault`` on ``args.fault_rank`` at training (or validation) batch ``args.at``."""

        def __init__(self):
            super().__init__()
            self.steps = 0

        def _maybe(self, state, where):
            rank = tbd.get_rank()
            if where == 'train':
                self.steps += 1
                if self.steps == 2:
                    print('ready', flush=True)
            if rank != args.fault_rank or not args.fault.endswith('-' + where):
                return
            if state[torchbearer.EPOCH] != args.epoch or state[torchbearer.BATCH] != args.at:
                return
            kind = args.fault.split('-')[0]
            print('fault', flush=True)
            if kind == 'raise':
                raise ValueError('boom in {} on rank {}'.format('training' if where == 'train' else 'validation',
                                                                rank))
            if kind == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == 'sleep':
                print('sleeping', flush=True)
                time.sleep(600)
            if kind == 'loader':  # a real DataLoader timeout: this rank's own error, whose text says "timed out"
                next(iter(DataLoader(_Slow(), num_workers=1, timeout=0.5)))

        def on_step_training(self, state):
            self._maybe(state, 'train')

        def on_step_validation(self, state):
            self._maybe(state, 'val')

    class _Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            time.sleep(30)
            return torch.zeros(1)

    torch.manual_seed(0)
    x, y = torch.randn(512, 8), torch.randint(0, 2, (512,))
    train = TensorDataset(x[:384], y[:384])
    val = TensorDataset(x[384:], y[384:])
    world = tbd.get_world_size()
    rank = tbd.get_rank()
    train_loader = DataLoader(train, batch_size=8, sampler=DistributedSampler(train, world, rank, seed=0))
    val_loader = DataLoader(val, batch_size=8, sampler=DistributedSampler(val, world, rank, shuffle=False))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [Fault(), *tbd.distributed_callbacks()]
    if args.step_delay:
        callbacks.insert(0, torchbearer.callbacks.on_step_training(lambda state: time.sleep(args.step_delay)))
    trial = Trial(model, optimizer, torch.nn.functional.cross_entropy, metrics=['loss'], callbacks=callbacks,
                  verbose=0)
    return trial.with_generators(train_loader, val_generator=val_loader)


def _deadlock(args):
    """Both ranks wait in ``recv`` for each other: blocked mid-collective until the timeout."""
    import torch
    import torch.distributed as dist
    print('ready', flush=True)
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def _launched_deadlock():
    _deadlock(None)


def _fail_first_attempt():
    """Under torchrun: rank 1 raises in the first attempt; every attempt all-reduces first."""
    import torch
    import torch.distributed as dist
    attempt = os.environ['TORCHELASTIC_RESTART_COUNT']
    total = torch.ones(1)
    dist.all_reduce(total)
    if attempt == '0' and dist.get_rank() == 1:
        raise ValueError('fails in the first attempt')
    dist.all_reduce(total)
    print('attempt {} rank {} ok {:g}'.format(attempt, dist.get_rank(), total.item()), flush=True)


def _hold_at_start(rank):
    """With ``FAULT_RANK_HOLD=<rank> <where>``, hold that rank before it imports torch, so that a test can
    send it a signal there: ``start`` sleeps (SIGINT then meets only Python's default handler, as during
    ``import torch``); ``finalizer`` runs a weakref callback, as importlib's module locks run while torch
    is imported, which spins in Python code, where CPython raises a SIGINT's KeyboardInterrupt and, because
    a finalizer cannot raise, reports it as "Exception ignored in" and drops it."""
    held, _, where = os.environ.get('FAULT_RANK_HOLD', '').partition(' ')
    if held != str(rank):
        return
    if where == 'start':
        print('held at start', flush=True)
        time.sleep(60)
    elif where == 'finalizer':
        import weakref

        class Lock:
            pass

        def callback(_):
            print('held in a finalizer', flush=True)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not os.path.exists(os.environ['FAULT_RANK_RELEASE']):
                sum(range(1000))  # Python code: where a pending signal's handler runs

        lock = Lock()
        ref = weakref.ref(lock, callback)  # noqa: F841 (kept alive until the callback has run)
        del lock
        print('left the finalizer', flush=True)


def main(argv=None):
    """Run one rank by hand, as a user does on each machine; print the error in one line and exit 1.

    With ``--launch N`` start N local ranks with :func:`torchbearer_dist.launch` instead, each blocked
    in a collective.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument('--rank', type=int, default=0)
    parser.add_argument('--launch', type=int, default=0)
    parser.add_argument('--start-method', type=str, default=None)
    parser.add_argument('--torchrun', action='store_true')
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--host', type=str, default='127.0.0.1')
    parser.add_argument('--port', type=int, default=None)
    parser.add_argument('--timeout', type=float, default=TIMEOUT)
    parser.add_argument('--rendezvous-timeout', type=float, default=RENDEZVOUS_TIMEOUT)
    parser.add_argument('--fault', type=str, default='none')
    parser.add_argument('--fault-rank', type=int, default=1)
    parser.add_argument('--epoch', type=int, default=0)
    parser.add_argument('--at', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--step-delay', type=float, default=0.0)
    args = parser.parse_args(argv)
    os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')  # one line per error, as the example does
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack: why a rank hangs
    _hold_at_start(args.rank)
    import torch
    torch.set_num_threads(1)
    import torchbearer_dist as tbd
    if args.torchrun:
        with tbd.process_group(backend='gloo', timeout=args.timeout):
            _fail_first_attempt()
        return
    if args.launch:
        try:
            tbd.launch(_launched_deadlock, args.launch, port=args.port, timeout=args.timeout,
                       rendezvous_timeout=args.rendezvous_timeout, start_method=args.start_method)
        except KeyboardInterrupt:
            print('error: interrupted', file=sys.stderr, flush=True)
            sys.exit(130)
        return
    tbd.watch_interrupts()  # a command line owns its process, as the example's does
    if os.environ.get('FAULT_RANK_SAY_WATCHED') == '1':  # when, on the machine's monotonic clock (all processes')
        print('interrupts watched at {:.3f}'.format(time.monotonic()), flush=True)
    try:
        with tbd.process_group(rank=args.rank, world_size=args.world_size, host=args.host, port=args.port,
                               backend='gloo', timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout):
            if args.fault == 'deadlock':
                _deadlock(args)
            else:
                history = _build_trial(args).run(args.epochs)
                print('done {} epochs'.format(len(history)), flush=True)
    except KeyboardInterrupt:
        print('error: interrupted', file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as error:
        print('error: {}'.format(error), file=sys.stderr, flush=True)
        sys.exit(1)



if __name__ == '__main__':
    main()
