"""How :func:`~torchbearer_dist.launch` watches its ranks: their stderr passed on and its last lines kept; the
applier of the launcher's events (:func:`~torchbearer_dist.runtime._decision.fold` decides), which collects the
reports, stops the others after the first failure, names the root cause, and stops a frozen last rank."""
import collections
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing import connection, resource_tracker, util

from torchbearer_dist._once import warn_once
from torchbearer_dist.runtime import _decision, _peers, errors, interrupts
from torchbearer_dist.runtime._timing import Timing

#: What is lost when multiprocessing's finalizers moved (see :func:`release_multiprocessing_objects`).
LOST = ("multiprocessing.util._run_finalizers is gone from this Python: a rank that fails exits without "
        "unlinking its multiprocessing semaphores, and the resource tracker warns of them after launch's error")


class RemoteTraceback(Exception):
    """Carries a rank's traceback text as the ``__cause__`` of the error re-raised in the launcher."""


def release_multiprocessing_objects():
    """For a rank that ends with ``os._exit``, which skips them: run multiprocessing's exit finalizers with a
    priority, which unlink its named semaphores (a ``Lock``, tqdm's write lock); else the resource tracker,
    shared with the launcher, warns of a leaked semaphore after the launcher's one-line cause."""
    run = getattr(util, '_run_finalizers', None)  # private: the function multiprocessing's own exit calls
    if run is None:
        warn_once(LOST)
        return
    run(0)


def stop(processes):
    """SIGKILL every rank still running, and reap it. Not SIGTERM: a rank takes it as a pre-emption
    (watch_preemption) and goes on to its next step boundary, which a rank blocked in a collective never reaches."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def error_for(rank, report, exitcode, stderr):
    """The error launch raises for rank ``rank``: its ``report``'s, ``rank R failed:`` in front and its traceback
    as the cause, or, where it sent none (None), its ``exitcode`` and its last lines on ``stderr``
    (:class:`StderrTail`, drained first)."""
    if report is None:
        stderr.drain()
        name = signal.Signals(-exitcode).name if exitcode is not None and exitcode < 0 else None
        how = 'was killed by {}'.format(name) if name else 'exited with status {}'.format(exitcode)
        last = [line for line in stderr.tail(rank) if line.strip()]
        words = '; its last lines on stderr: {}\n{}'.format(last[-1].strip(), '\n'.join(
            '    ' + line for line in last)) if last else ''
        return RuntimeError('rank {} {} before reporting an error{}'.format(rank, how, words))
    _, line, text, error = report
    if isinstance(error, errors.PeerFailedError):
        pass  # its message names the rank at fault, and this one as "(rank R stopped)"
    elif error is None:
        error = RuntimeError(line if line.startswith('rank ') else 'rank {} failed: {}'.format(rank, line))
    elif len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = ('rank {} failed: {}'.format(rank, error.args[0]),)
    else:
        error = RuntimeError('rank {} failed: {}'.format(rank, line))
    error.__cause__ = RemoteTraceback('traceback of rank {}:\n{}'.format(rank, text))
    return error


#: Lines of each rank's stderr kept for the error of a rank that dies before reporting.
_TAIL_LINES = 20


class StderrTail:
    """Each rank's stderr, passed on to this process's ``sys.stderr`` line by line, its last lines kept: a rank
    that dies before it can report (a function it cannot import, a crash in C++) leaves its cause in the error,
    and in Jupyter the ranks' output shows in the notebook."""

    def __init__(self):
        self.lines, self._threads = {}, []

    def start(self, rank, make_process, as_argument=False):
        """Start ``make_process(write_end)``, rank ``rank``'s process, with its stderr on a pipe read here: passed
        as a Connection ``as_argument`` (a forkserver's rank does not inherit fd 2), else this process's fd 2
        while the rank starts, so that even an error before its code runs (unpickling its function) is caught."""
        read_end, write_end = os.pipe()
        if as_argument:
            write_end = connection.Connection(write_end, readable=False)
            process = make_process(write_end)
            try:
                process.start()
            finally:
                write_end.close()
        else:
            process = make_process(None)
            # started now, it keeps the launcher's own stderr, not this rank's pipe (which drain() would wait on)
            resource_tracker.ensure_running()
            saved = os.dup(2)
            try:
                os.dup2(write_end, 2)
                process.start()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(write_end)
        self.lines[rank] = collections.deque(maxlen=_TAIL_LINES)
        thread = threading.Thread(target=self._pump, args=(read_end, self.lines[rank]),
                                  name='torchbearer_dist-stderr{}'.format(rank), daemon=True)
        thread.start()
        self._threads.append(thread)
        return process

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

    def drain(self, seconds=Timing.DRAIN):
        """Wait up to ``seconds`` for the ranks' last output (a rank's own child may hold the pipe longer)."""
        deadline = time.monotonic() + seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def tail(self, rank):
        """list: the last lines rank ``rank`` wrote to stderr."""
        return list(self.lines.get(rank, ()))


def _stat(pid):
    """``(state, CPU seconds used so far by all its threads)`` of process ``pid``, or ``('', None)``."""
    fields = _peers.stat(pid)
    return ('', None) if fields is None else (fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK'))


def _stalled(marks, rank, pid, now, bound):
    """Whether a rank left running alone has been idle (under 1% of a core) for ``bound`` seconds, ``marks``
    keeping when each was last seen working: one that goes on working (rank-0-only work) uses CPU time; one
    frozen or waiting for gone peers uses none."""
    state, cpu = _stat(pid)
    since, used = marks.setdefault(rank, (now, cpu))
    if cpu is not None and used is not None and cpu - used > Timing.IDLE_SHARE * (now - since) + Timing.IDLE_SLACK:
        marks[rank] = (now, cpu)
        return False
    # a stopped process is frozen for sure; any other gets time for its own heartbeat to name a peer
    return now - since > bound - (Timing.STOPPED_EARLY if state in ('T', 't') else 0.0)


def supervise(processes, pipes, deadline, grace, last_rank_bound, stderr, started=None):
    """Watch the ranks until they end, the applier of the launcher's events (:func:`~._decision.fold`): it senses
    their exit statuses, reports and ``/proc``, folds each :class:`~._decision.Poll` and does what the actions say.
    Returns ``(results, error, restarts)``: what each rank returned, in rank order, or the root cause's error and
    whether launch starts every rank again. ``started``: when the ``deadline``'s clock started
    (:func:`time.monotonic`; now by default)."""
    reports, marks, started = {}, {}, time.monotonic() if started is None else started  # marks: for _stalled
    watch, event = _decision.Watch(grace, last_rank_bound, deadline), _poll(processes, pipes, reports, started)
    while True:
        watch, actions = _decision.fold(watch, event)
        for action, *args in actions:
            if action == _decision.FORWARD:  # under watch_preemption() in this process
                for rank in args[0]:
                    os.kill(processes[rank].pid, signal.SIGTERM)
            elif action == _decision.SENSE:
                event = dataclasses.replace(event, stalled=frozenset(
                    r for r in args[0] if _stalled(marks, r, processes[r].pid, event.now, last_rank_bound)))
            elif action == _decision.WAIT:
                connection.wait([p.sentinel for p in processes] + pipes, timeout=Timing.CHILDREN_POLL)
                event = _poll(processes, pipes, reports, started)
            elif action == _decision.RETURN:
                return [reports[r][1] for r in range(len(processes))], None, False
            elif action == _decision.FAIL:
                return None, args[0](args[1]), args[2]
            else:  # NAME: every rank stopped first (one still running reads as killed)
                stop(processes)
                return None, error_for(args[0], reports.get(args[0]), processes[args[0]].exitcode, stderr), args[1]


def _poll(processes, pipes, reports, started):
    """What the ranks show now, on the clock started at ``started``, as a :class:`~._decision.Poll`: their exit
    statuses read first, so that a rank seen ended has its report collected into ``reports`` (None: a broken pipe)."""
    exitcodes = tuple(process.exitcode for process in processes)
    for rank, pipe in enumerate(pipes):
        if rank not in reports and pipe.poll():
            try:
                reports[rank] = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                reports[rank] = None
    states = tuple(None if report is None else 'ok' if report[0] == 'ok' else 'peer' if isinstance(
        report[3], errors.PeerFailedError) else 'own' for report in map(reports.get, range(len(processes))))
    stopped = frozenset(r for r, code in enumerate(exitcodes)
                        if code is None and _stat(processes[r].pid)[0] in ('T', 't'))
    return _decision.Poll(time.monotonic() - started, exitcodes, states, stopped,
                          interrupts.preemption_requested() is not None)
