"""How :func:`~torchbearer_dist.launch` watches its ranks: their stderr passed on and its last lines kept; the
loop that collects the reports, stops the others after the first failure, names the root cause
(:func:`~torchbearer_dist.runtime._decision.first_failure`), and stops a frozen last rank."""
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
from torchbearer_dist.runtime import _peers, errors, interrupts
from torchbearer_dist.runtime._decision import first_failure
from torchbearer_dist.runtime._timing import Timing

#: What is lost when multiprocessing's finalizers moved (see :func:`release_multiprocessing_objects`).
LOST = ("multiprocessing.util._run_finalizers is gone from this Python: a rank that fails exits without "
        "unlinking its multiprocessing semaphores, and the resource tracker warns of them after launch's error")


class RemoteTraceback(Exception):
    """Carries a rank's traceback text as the ``__cause__`` of the error re-raised in the launcher."""


def _collect(pipes, reports):
    """Add to ``reports`` what each rank that has not reported yet sent (None: its pipe broke)."""
    for rank, pipe in enumerate(pipes):
        if rank not in reports and pipe.poll():
            try:
                reports[rank] = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                reports[rank] = None


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


def error_for(rank, report, exitcode, tail):
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


@dataclasses.dataclass
class Ending:
    """What :func:`supervise` saw of a start of the ranks that did not succeed: the facts that launch's restart
    policy reads (:func:`~torchbearer_dist.runtime._decision.restarts_after`)."""
    watched: bool = False  # every rank started and was watched: a failure to start one (its function not picklable)
    # is the launcher's own
    preempted: bool = False  # a pre-emption signal reached the launcher (and was passed on to the ranks)
    deadline: bool = False  # the deadline passed, and the ranks still running were stopped
    status: int = None  # the exit status of the rank named as the root cause (None: it was still running)


def supervise(processes, pipes, deadline, grace, last_rank_bound, stderr, started=None, ending=None):
    """Watch the ranks until they end: what each returned, in rank order, or the root cause's error raised.
    ``started``: when the ``deadline``'s clock started (:func:`time.monotonic`; now by default); ``ending``: an
    :class:`Ending` that learns why, when the ranks did not all succeed."""
    reports = {}
    started = time.monotonic() if started is None else started
    ending = Ending() if ending is None else ending
    ending.watched = True
    failed_at = None
    forwarded = False
    marks = {}  # for _stalled
    while True:
        if interrupts.preemption_requested() and not forwarded:  # under watch_preemption() in this process
            forwarded = ending.preempted = True
            for process in processes:
                if process.exitcode is None:
                    os.kill(process.pid, signal.SIGTERM)
        _collect(pipes, reports)
        failed = any(p.exitcode not in (None, 0) for p in processes) or any(
            rep is not None and rep[0] == 'error' for rep in reports.values())
        if failed and failed_at is None:
            failed_at = time.monotonic()
        running = [r for r, p in enumerate(processes) if p.exitcode is None]
        if failed_at and all(_stat(processes[r].pid)[0] in ('T', 't') for r in running):
            break  # the rest are stopped by a signal: they will not report
        if all(p.exitcode is not None for p in processes) or (failed_at and time.monotonic() - failed_at > grace):
            break
        if not failed and len(running) < len(processes):
            stalled = [r for r in running if _stalled(marks, r, processes[r].pid, time.monotonic(), last_rank_bound)]
            if stalled:  # a stopped process first: the others may be waiting for it
                stalled.sort(key=lambda r: _stat(processes[r].pid)[0] not in ('T', 't'))
                raise RuntimeError('rank {} did not end within {:g} s of the other ranks, and used no CPU '
                                   'meanwhile: it is frozen (stopped by a signal, or stuck in native code); '
                                   'stopped it'.format(stalled[0], last_rank_bound))
        if deadline is not None and time.monotonic() - started > deadline:
            ending.deadline = True
            raise RuntimeError('ranks {} still running after the {:g} s deadline; stopped them'.format(
                running, deadline))
        connection.wait([p.sentinel for p in processes] + pipes, timeout=Timing.CHILDREN_POLL)
    _collect(pipes, reports)
    results = {rank: report[1] for rank, report in reports.items() if report is not None and report[0] == 'ok'}
    if len(results) == len(processes):
        return [results[r] for r in range(len(processes))]
    states = [_state(reports.get(r)) for r in range(len(processes))]
    rank = first_failure(states, [p.exitcode for p in processes], interrupts.EXIT_PREEMPTED)
    if rank is None:
        raise interrupts.Preempted('every rank was pre-empted after its checkpoint; run again to resume')
    ending.status = processes[rank].exitcode
    stop(processes)
    ending.preempted = ending.preempted or interrupts.preemption_requested() is not None
    if reports.get(rank) is None:
        stderr.drain()
    raise error_for(rank, reports.get(rank), processes[rank].exitcode, stderr.tail(rank))


def _state(report):
    """What a rank's report says, as :func:`~torchbearer_dist.runtime._decision.first_failure` reads it."""
    if report is None or report[0] == 'ok':
        return None if report is None else 'ok'
    return 'peer' if isinstance(report[3], errors.PeerFailedError) else 'own'
