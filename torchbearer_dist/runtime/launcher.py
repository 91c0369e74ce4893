"""Start N ranks on this machine and watch them: the first failure stops the rest and is re-raised.

Children die with their parent (``PR_SET_PDEATHSIG``), so a killed launcher never leaves a rank
behind holding the port, and Ctrl-C stops every rank within a few seconds: the launcher owns its
ranks' processes, so it turns on :func:`~torchbearer_dist.watch_interrupts` in each.
"""
import collections
import ctypes
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing import connection, get_context

import torch

from torchbearer_dist.runtime import _diagnosis, errors, group, interrupts
from torchbearer_dist.runtime.env import resolve, with_rendezvous_timeout

_PR_SET_PDEATHSIG = 1


class RemoteTraceback(Exception):
    """Carries a rank's traceback text as the ``__cause__`` of the error re-raised in the launcher."""

    def __str__(self):
        return self.args[0]


def free_port(host='127.0.0.1'):
    """A TCP port that is free on ``host`` right now.

    Args:
        host (str): the address to probe

    Returns:
        int: the port
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent(parent_pid):
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if it already did."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux: the launcher's finally still cleans up
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _die_with_launcher(launcher_pid):
    """SIGKILL this process when process ``launcher_pid`` exits; exit now if it already has (Linux >= 5.3).

    For a rank forked by multiprocessing's forkserver, whose parent is that server, not the launcher:
    the server outlives the launcher while any of its children lives, so ``PR_SET_PDEATHSIG`` would
    never fire. A daemon thread waits on a pidfd of the launcher instead.
    """
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
           stderr=None):
    if stderr is None:
        die_with_parent(parent_pid)
    else:  # forked by the forkserver: this rank's stderr pipe came as an argument (see _StderrTail)
        _die_with_launcher(parent_pid)
        sys.stderr.flush()
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR=host, MASTER_PORT=str(port))
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
        try:
            payload = error if _picklable(error) else None
        except Exception:
            payload = None
        _send(conn, ('error', _diagnosis.describe(error), traceback.format_exc(), payload))
        conn.close()
        sys.stderr.flush()
        os._exit(interrupts.EXIT_PREEMPTED if isinstance(error, interrupts.Preempted) else
                 130 if isinstance(error, KeyboardInterrupt) else 1)
    conn.close()


def _send(conn, message):
    # Plain pickle copies tensors; multiprocessing's would share them through this process, which exits.
    conn.send_bytes(pickle.dumps(message))


def _receive(conn):
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _picklable(error):
    try:
        pickle.loads(pickle.dumps(error))
        return True
    except Exception:
        return False


def _stop(processes, grace):
    for process in processes:
        if process.is_alive():
            # SIGKILL, not SIGTERM: a rank takes SIGTERM as a pre-emption (watch_preemption) and would go on
            # to its next step boundary, which a rank blocked in a collective never reaches
            process.kill()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _error_for(rank, report, exitcode, tail=()):
    if report is None:
        name = signal.Signals(-exitcode).name if exitcode is not None and exitcode < 0 else None
        how = 'was killed by {}'.format(name) if name else 'exited with status {}'.format(exitcode)
        last = [line for line in tail if line.strip()]
        if not last:
            return RuntimeError('rank {} {} before reporting an error'.format(rank, how))
        return RuntimeError('rank {} {} before reporting an error; its last lines on stderr: {}\n{}'.format(
            rank, how, last[-1].strip(), '\n'.join('    ' + line for line in last)))
    _, line, text, error = report
    if isinstance(error, errors.PeerFailedError):
        pass  # its message names the rank at fault, and this one as "(rank R stopped)"
    elif error is None:
        error = RuntimeError(line)
        if error.args and not str(error).startswith('rank '):
            error.args = ('rank {} failed: {}'.format(rank, error.args[0]),)
    elif len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = ('rank {} failed: {}'.format(rank, error.args[0]),)
    else:
        error = RuntimeError('rank {} failed: {}'.format(rank, line))
    error.__cause__ = RemoteTraceback('traceback of rank {}:\n{}'.format(rank, text))
    return error


#: Lines of each rank's stderr kept for the error of a rank that dies before reporting.
_TAIL_LINES = 20


class _StderrTail:
    """Each rank's stderr, passed on to this process's ``sys.stderr`` line by line, its last lines kept.

    A rank's file descriptor 2 is a pipe read here, so that a rank that dies before it can report
    (a function a spawned rank cannot import, a crash in C++) still leaves its cause in the error,
    and so that in Jupyter the ranks' output shows in the notebook rather than the kernel's terminal.
    """

    def __init__(self):
        self.lines, self._threads, self._pending = {}, [], {}

    def pipe(self):
        """A new pipe for a forkserver rank: its write end as a Connection to pass to the rank."""
        read_end, write_end = os.pipe()
        self._pending[write_end] = read_end
        return connection.Connection(write_end, readable=False)

    def start(self, rank, process, write_end=None):
        """Start ``process`` (rank ``rank``) with its stderr on a pipe read by a thread of this process.

        Args:
            rank (int): the rank
            process (multiprocessing.Process): not started yet
            write_end (multiprocessing.connection.Connection): for a forkserver rank, the pipe's write
                end, already among the process's arguments (a forked server's child does not inherit
                this process's file descriptor 2); by default the pipe is made here and is this
                process's file descriptor 2 while the rank starts, so that even an error before the
                rank's code runs (unpickling its function) is caught
        """
        if write_end is None:
            read_end, write_end = os.pipe()
            saved = os.dup(2)
            try:
                os.dup2(write_end, 2)
                process.start()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(write_end)
        else:
            read_end = self._pending.pop(write_end.fileno())
            try:
                process.start()
            finally:
                write_end.close()
        self.lines[rank] = collections.deque(maxlen=_TAIL_LINES)
        thread = threading.Thread(target=self._pump, args=(read_end, self.lines[rank]),
                                  name='torchbearer_dist-stderr{}'.format(rank), daemon=True)
        thread.start()
        self._threads.append(thread)

    @staticmethod
    def _pump(read_end, lines):
        with os.fdopen(read_end, 'rb') as pipe:
            for raw in pipe:
                line = raw.decode(errors='replace')
                lines.append(line.rstrip('\n'))
                try:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                except (OSError, ValueError, AttributeError):
                    pass

    def drain(self, seconds=2.0):
        """Wait up to ``seconds`` for the ranks' last output (a rank's own child may hold the pipe longer)."""
        deadline = time.monotonic() + seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def tail(self, rank):
        """list: the last lines rank ``rank`` wrote to stderr."""
        return list(self.lines.get(rank, ()))


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
           deadline=None, grace=3.0, rendezvous_timeout=None, start_method=None):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks, each inside an initialized process group.

    The port is picked in the parent. When a rank fails, the others are stopped and that rank's
    error is re-raised here with ``rank R failed:`` in front of its message and its traceback as the
    cause. A rank that stops only because a peer failed is never mistaken for the root cause. A
    rank still running once the others have ended, and using no CPU for the rendezvous timeout
    (frozen by a signal, or stuck), is stopped and named; one that goes on working is left alone.

    Example:

        .. code-block:: python

            def worker(epochs):
                trial = make_trial()          # a Trial with torchbearer_dist's callbacks
                return trial.run(epochs)

            if __name__ == '__main__':
                histories = torchbearer_dist.launch(worker, world_size=2, args=(5,))

    Args:
        fn (callable): a module-level function (pickled to start each rank), or a function of a Jupyter
            cell or other interactive session (the ranks are then forked, see ``start_method``)
        world_size (int): number of ranks to start, at least 1
        args (tuple): positional arguments for ``fn``
        kwargs (dict): keyword arguments for ``fn``
        host (str): address the rendezvous store listens on
        port (int): port of the store; a free one by default
        backend (str): ``'gloo'`` (the default) or ``'nccl'``
        timeout (float): seconds each collective may take; 30 minutes by default, as torch's
        deadline (float): seconds after which every rank is killed and RuntimeError raised; none by default
        grace (float): seconds ranks get to exit after SIGTERM before SIGKILL
        rendezvous_timeout (float): seconds for the ranks to meet, and for a silent peer to end the job
        start_method (str): ``'spawn'``, ``'fork'`` or ``'forkserver'``; by default ``'fork'`` for a function
            defined in an interactive session (a Jupyter cell), which a spawned rank cannot import, else
            ``'spawn'``. ``'forkserver'`` forks each rank from a server process started once per program,
            which imports what :func:`multiprocessing.set_forkserver_preload` names (by default the main
            module, and so what it imports, torch included): for a program that calls ``launch`` many times
            (a sweep, a test suite), each later launch starts its ranks in milliseconds instead of
            importing torch afresh in each

    Returns:
        list: what ``fn`` returned on each rank, in rank order

    Raises:
        ValueError: a bad ``world_size`` or ``start_method``
        RuntimeError: ``'fork'`` where CUDA is already initialized in this process
        Exception: the first failing rank's error, its message starting ``rank R failed:``; a rank that
            died before it could report carries its last lines of stderr
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError('world_size should be an integer >= 1, but given {!r}'.format(world_size))
    method = _start_method(fn, start_method)
    context = get_context(method)
    port = free_port(host) if port is None else port
    processes, pipes, stderr = [], [], _StderrTail()
    try:
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            write_end = stderr.pipe() if method == 'forkserver' else None  # a child of the server, not of us
            process = context.Process(target=_child, name='torchbearer_dist-rank{}'.format(rank), args=(
                fn, rank, world_size, host, port, backend, timeout, rendezvous_timeout, args, kwargs, child_end,
                os.getpid(), write_end))
            stderr.start(rank, process, write_end)
            child_end.close()
            processes.append(process)
            pipes.append(parent_end)
        interrupts.training(True)  # a pre-emption signal here is forwarded to the ranks (see _supervise)
        try:
            return _supervise(processes, pipes, deadline, grace, _last_rank_bound(timeout, rendezvous_timeout),
                              stderr)
        finally:
            interrupts.training(False)
    finally:
        _stop(processes, grace)
        stderr.drain()


def _last_rank_bound(timeout, rendezvous_timeout):
    """Seconds the last rank may sit idle once the others have ended: the ranks' rendezvous timeout."""
    env = resolve(rank=0, world_size=1, timeout=timeout, environ={})
    # and time for the ranks' own heartbeat to name a frozen peer first: two beats and a second
    return with_rendezvous_timeout(env, rendezvous_timeout, os.environ).meet_timeout.total_seconds() + 3.0


def _stat(pid):
    """``(state, CPU seconds used so far by all its threads)`` of process ``pid``, or ``('', None)``."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            fields = f.read().rsplit(')', 1)[1].split()
        return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, IndexError):
        return '', None


class _Idle:
    """Whether a rank left running alone has been idle (under 1% of a core) for ``bound`` seconds.

    A rank that goes on working once the others have ended (rank-0-only work) uses CPU time and is
    left alone; one that is frozen (SIGSTOP) or stuck waiting for peers that have gone uses none.
    """

    def __init__(self, bound):
        self.bound, self.marks = bound, {}

    def stalled(self, rank, pid, now):
        state, cpu = _stat(pid)
        since, used = self.marks.setdefault(rank, (now, cpu))
        if cpu is not None and used is not None and cpu - used > 0.01 * (now - since) + 0.05:
            self.marks[rank] = (now, cpu)
            return False
        # a stopped process is frozen for sure; any other gets time for its own heartbeat to name a peer
        return now - since > self.bound - (3.0 if state in ('T', 't') else 0.0)


def _supervise(processes, pipes, deadline, grace, last_rank_bound=None, stderr=None):
    reports, results = {}, {}
    started = time.monotonic()
    failed_at = None
    forwarded = False
    idle = _Idle(last_rank_bound)
    while True:
        if interrupts.preemption_requested() and not forwarded:  # under watch_preemption() in this process
            forwarded = True
            for process in processes:
                if process.exitcode is None:
                    os.kill(process.pid, signal.SIGTERM)
        for rank, pipe in enumerate(pipes):
            if rank not in reports and pipe.poll():
                reports[rank] = _receive(pipe)
        failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
        failed += [r for r, rep in reports.items() if rep is not None and rep[0] == 'error' and r not in failed]
        if failed and failed_at is None:
            failed_at = time.monotonic()
        running = [r for r, p in enumerate(processes) if p.exitcode is None]
        if failed_at and all(_stat(processes[r].pid)[0] in ('T', 't') for r in running):
            break  # the rest are stopped by a signal: they will not report
        if all(p.exitcode is not None for p in processes) or (failed_at and time.monotonic() - failed_at > grace):
            break
        if last_rank_bound is not None and not failed and len(running) < len(processes):
            stalled = [r for r in running if idle.stalled(r, processes[r].pid, time.monotonic())]
            if stalled:  # a stopped process first: the others may be waiting for it
                stalled.sort(key=lambda r: _stat(processes[r].pid)[0] not in ('T', 't'))
                raise RuntimeError('rank {} did not end within {:g} s of the other ranks, and used no CPU '
                                   'meanwhile: it is frozen (stopped by a signal, or stuck in native code); '
                                   'stopped it'.format(stalled[0], last_rank_bound))
        if deadline is not None and time.monotonic() - started > deadline:
            running = [r for r, p in enumerate(processes) if p.exitcode is None]
            raise RuntimeError('ranks {} still running after the {:g} s deadline; stopped them'.format(
                running, deadline))
        connection.wait([p.sentinel for p in processes] + pipes, timeout=0.1)
    for rank, pipe in enumerate(pipes):
        if rank not in reports and pipe.poll():
            reports[rank] = _receive(pipe)
    for rank, report in reports.items():
        if report is not None and report[0] == 'ok':
            results[rank] = report[1]
    if len(results) == len(processes):
        return [results[r] for r in range(len(processes))]
    died = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in results]
    if died and all(processes[r].exitcode == interrupts.EXIT_PREEMPTED for r in range(len(processes))
                    if r not in results):
        raise interrupts.Preempted('every rank was pre-empted after its checkpoint; run again to resume')
    _stop(processes, grace)
    own = [r for r, rep in sorted(reports.items()) if rep is not None and rep[0] == 'error' and not _peer_failure(rep)]
    peer = [r for r, rep in sorted(reports.items()) if _peer_failure(rep)]
    rank = (own + [r for r in died if reports.get(r) is None] + peer + [r for r in range(len(processes))
                                                                        if r not in results])[0]
    if stderr is not None and reports.get(rank) is None:
        stderr.drain()
    raise _error_for(rank, reports.get(rank), processes[rank].exitcode, stderr.tail(rank) if stderr else ())


def _peer_failure(report):
    return report is not None and report[0] == 'error' and report[1].startswith(errors.PeerFailedError.__name__)
