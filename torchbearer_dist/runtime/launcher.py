"""Start N ranks on this machine and watch them (:mod:`._supervisor`): the first failure stops the rest and is
re-raised, or, with ``max_restarts``, every rank is started again (torchrun's policy). A killed launcher leaves no
rank behind holding the port, and, as it owns its ranks' processes, it turns on
:func:`~torchbearer_dist.watch_interrupts` in each, so that Ctrl-C stops every rank within seconds."""
import ctypes
import functools
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from multiprocessing import get_context

import torch

from torchbearer_dist.runtime import _diagnosis, _supervisor, group, interrupts
from torchbearer_dist.runtime._timing import Timing
from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout
from torchbearer_dist.runtime.network import free_port

_PR_SET_PDEATHSIG = 1
#: Where each rank of ``launch(max_restarts=R)`` finds which start it is (0 first): torchrun's own name, so that what
#: reads torchrun's count (the fault-tolerant mode's ``RESTART_COUNTS``, a user's resume logic) reads launch's too.
RESTART_COUNT = 'TORCHELASTIC_RESTART_COUNT'


def die_with_parent(parent_pid):
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if it already did."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux: the launcher's finally still cleans up
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _die_with_launcher(launcher_pid):
    """:func:`die_with_parent` for a rank of the forkserver, whose parent outlives the launcher: a daemon thread
    waits on the launcher's pidfd (Linux >= 5.3)."""
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: the launcher's finally still cleans up
        return

    def watch():
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name='torchbearer_dist-launcher-watch', daemon=True).start()


def _child(fn, rank, world_size, host, port, backend, timeout, rendezvous_timeout, args, kwargs, conn, parent_pid,
           restart=None, stderr=None):
    if stderr is None:
        die_with_parent(parent_pid)
    else:  # forked by the forkserver: this rank's stderr pipe came as an argument (see _supervisor.StderrTail)
        _die_with_launcher(parent_pid)
        sys.stderr.flush()
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR=host, MASTER_PORT=str(port))
    if restart is not None:  # launch(max_restarts=R): which start this is, under torchrun's name
        os.environ[RESTART_COUNT] = str(restart)
    if 'OMP_NUM_THREADS' not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    interrupts.watch_interrupts()  # the launcher owns its ranks: Ctrl-C handling is on
    interrupts.watch_preemption()  # and SIGTERM / SIGUSR1 stop training at a step with a checkpoint
    try:
        with group.process_group(rank=rank, world_size=world_size, host=host, port=port, backend=backend,
                                 timeout=timeout, rendezvous_timeout=rendezvous_timeout):
            result = fn(*args, **(kwargs or {}))
        _send(conn, ('ok', result))
    except BaseException as error:
        payload = error if _picklable(error) else None
        _send(conn, ('error', _diagnosis.describe(error), traceback.format_exc(), payload))
        conn.close()
        _supervisor.release_multiprocessing_objects()  # which os._exit skips: the semaphores this rank made
        sys.stderr.flush()
        os._exit(interrupts.EXIT_PREEMPTED if isinstance(error, interrupts.Preempted) else
                 130 if isinstance(error, KeyboardInterrupt) else 1)
    conn.close()


def _send(conn, message):
    # Plain pickle copies tensors; multiprocessing's would share them through this process, which exits.
    conn.send_bytes(pickle.dumps(message))


def _picklable(error):
    try:
        pickle.loads(pickle.dumps(error))
        return True
    except Exception:
        return False


def _start_method(fn, start_method):
    """``'spawn'``, or ``'fork'`` for a function of an interactive session (Jupyter) that spawn cannot import."""
    if start_method not in (None, 'spawn', 'fork', 'forkserver'):
        raise ValueError("start_method should be 'spawn', 'fork', 'forkserver' or None (chosen for fn), but given "
                         "{!r}".format(start_method))
    if start_method is None:
        main = sys.modules.get('__main__')
        interactive = getattr(fn, '__module__', None) == '__main__' and not hasattr(main, '__file__')
        start_method = 'fork' if interactive else 'spawn'
    if start_method == 'fork' and torch.cuda.is_initialized():
        raise RuntimeError('CUDA is already initialized in this process, and ranks forked from it cannot use it; '
                           'restart the kernel and call launch() before anything touches CUDA, or define the '
                           "function in a .py file and pass start_method='spawn'")
    return start_method


def launch(fn, world_size, args=(), kwargs=None, host='127.0.0.1', port=None, backend=None, timeout=None,
           deadline=None, grace=Timing.KILL_GRACE, rendezvous_timeout=None, start_method=None, max_restarts=0):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks, each inside an initialized process group.

    The port is picked in the parent. When a rank fails, the others are stopped and its error is re-raised
    here, ``rank R failed:`` in front of its message and its traceback as the cause; a rank that stopped only
    because a peer failed is never taken for the root cause. A rank left running alone that uses no CPU for
    the rendezvous timeout (frozen, or stuck) is stopped and named; one that goes on working is left alone.

    With ``max_restarts=R``, launch follows torchrun's ``--max-restarts R``: after a failure it starts all
    ``world_size`` ranks again, up to ``R`` times, and each rank finds which start it is (0 first) in
    ``TORCHELASTIC_RESTART_COUNT``, torchrun's own name, so that code written for torchrun's restarts (resume
    from a checkpoint; the fault-tolerant mode, where the ranks are one replica group that heals from a live
    one) works unchanged. As torchrun does, any failure counts, even an error that will recur: a bug fails
    ``R + 1`` times. Each start meets on a new free port (or on ``port`` again, where given: the last start's
    ranks, whose rank 0 held its store, are all gone by then), so no rank meets the last start's store.
    Not restarted: the user's stop (Ctrl-C, a pre-emption signal to this process, a rank stopped by Ctrl-C),
    the ``deadline``, which bounds every start together, and a failure to start the ranks at all (``fn`` not
    picklable), which torchrun's agent does not restart either. Each restart prints one line to stderr, e.g.
    ``torchbearer_dist: rank 1 failed: bad batch; starting the 2 ranks again (restart 1 of 3)``.

    Example:

        .. code-block:: python

            def worker(epochs):
                trial = make_trial()          # a Trial with torchbearer_dist's callbacks
                return trial.run(epochs)

            if __name__ == '__main__':
                histories = torchbearer_dist.launch(worker, world_size=2, args=(5,))
                # as torchrun --max-restarts 3: every rank started again after a failure
                histories = torchbearer_dist.launch(worker, 2, args=(5,), max_restarts=3)

    Args:
        fn (callable): a module-level function (pickled to start each rank), or a function of a Jupyter
            cell or other interactive session (the ranks are then forked, see ``start_method``)
        world_size (int): number of ranks to start, at least 1
        args (tuple): positional arguments for ``fn``
        kwargs (dict): keyword arguments for ``fn``
        host (str): address the rendezvous store listens on
        port (int): port of the store; a free one by default, a new one at each restart
        backend (str): ``'gloo'`` (the default) or ``'nccl'``
        timeout (float): seconds each collective may take; 30 minutes by default, as torch's
        deadline (float): seconds after which every rank is killed and RuntimeError raised, restarts included;
            none by default
        grace (float): seconds to wait after the first failure for the other ranks' reports
        rendezvous_timeout (float): seconds for the ranks to meet, and for a silent peer to end the job
        start_method (str): ``'spawn'``, ``'fork'`` or ``'forkserver'``; by default ``'fork'`` for a function
            defined in an interactive session (a Jupyter cell), which a spawned rank cannot import, else
            ``'spawn'``. ``'forkserver'`` forks each rank from a server started once per program, which has
            imported torchbearer_dist (and so torch) once: for a program that calls ``launch`` many times (a
            sweep, a test suite), each later launch starts its ranks without importing torch afresh
        max_restarts (int): how many times to start every rank again after a failure, as torchrun's
            ``--max-restarts``; 0 (the default) raises the first failure, and sets no restart count

    Returns:
        list: what ``fn`` returned on each rank, in rank order (of the start that succeeded)

    Raises:
        ValueError: a bad ``world_size``, ``start_method`` or ``max_restarts``
        RuntimeError: ``'fork'`` where CUDA is already initialized in this process
        Exception: the first failing rank's error (of the last start, once the restarts are spent), its message
            starting ``rank R failed:``; a rank that died before it could report carries its last lines of stderr
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError('world_size should be an integer >= 1, but given {!r}'.format(world_size))
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError('max_restarts should be an integer >= 0, but given {!r}'.format(max_restarts))
    method = _start_method(fn, start_method)
    context = get_context(method)
    if method == 'forkserver':
        # imported once by the server before it forks any rank (set before it starts). Its default, '__main__',
        # is never imported by Python 3.11's server (cpython issue 98552): each rank would import torch afresh.
        context.set_forkserver_preload(['torchbearer_dist'])
    started = time.monotonic()  # the deadline's clock, over every start
    for restart in range(max_restarts + 1):  # a failure to start the ranks at all (fn not picklable) is raised
        results, error, restarts = _start(context, method, fn, world_size, args, kwargs, host, free_port(host)
                                          if port is None else port, backend, timeout, deadline, started, grace,
                                          rendezvous_timeout, restart if max_restarts else None)
        if error is None:
            return results
        if restart == max_restarts or not restarts:  # the fold's decision (see _decision.fold)
            raise error
        print('torchbearer_dist: {}; starting {} again (restart {} of {})'.format(
            _first_line(error), 'the rank' if world_size == 1 else 'the {} ranks'.format(world_size),
            restart + 1, max_restarts), file=sys.stderr, flush=True)


def _start(context, method, fn, world_size, args, kwargs, host, port, backend, timeout, deadline, started, grace,
           rendezvous_timeout, restart):
    """One start of every rank, watched until each has ended (all of them stopped and reaped on return):
    :func:`~._supervisor.supervise`'s ``(results, error, restarts)``."""
    processes, pipes, stderr = [], [], _supervisor.StderrTail()
    try:
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            child_args = (fn, rank, world_size, host, port, backend, timeout, rendezvous_timeout, args, kwargs,
                          child_end, os.getpid(), restart)
            # a forkserver's rank is a child of the server, not of this process: its stderr pipe is an argument
            process = stderr.start(rank, functools.partial(_rank_process, context, rank, child_args),
                                   as_argument=method == 'forkserver')
            child_end.close()
            processes.append(process)
            pipes.append(parent_end)
        interrupts.training(True)  # a pre-emption signal here is forwarded to the ranks (see _supervisor.supervise)
        try:
            return _supervisor.supervise(processes, pipes, deadline, grace,
                                         _last_rank_bound(timeout, rendezvous_timeout), stderr, started)
        finally:
            interrupts.training(False)
    finally:
        _supervisor.stop(processes)
        stderr.drain()


def _first_line(error):
    """The first line of ``error``'s message, for the restart's line (a KeyError's own str() quotes it)."""
    text = error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)
    return (text.splitlines() or [type(error).__name__])[0]


def _rank_process(context, rank, child_args, stderr):
    return context.Process(target=_child, name='torchbearer_dist-rank{}'.format(rank), args=child_args + (stderr,))


def _last_rank_bound(timeout, rendezvous_timeout):
    """Seconds the last rank may sit idle once the others have ended (:class:`~._timing.Timing`'s ``last_rank``)."""
    env = resolve(rank=0, world_size=1, timeout=timeout, environ={})
    return Timing.of(with_rendezvous_timeout(env, rendezvous_timeout, os.environ)).last_rank
