"""Ctrl-C and pre-emption signals for programs that own their process: the launcher's ranks and the examples.

Opt-in (:func:`watch_interrupts`, :func:`watch_preemption`): library use leaves every signal handler and the
wakeup fd alone. A handler installed here calls the one it replaced, and the ``unwatch_`` functions put it
back. How a rank blocked in a gloo collective still takes Ctrl-C: docs/troubleshooting.rst, "Ctrl-C".
"""
import os
import signal
import sys
import threading
import time

from torchbearer_dist.runtime import env
from torchbearer_dist.runtime._timing import Timing
from torchbearer_dist.runtime.errors import EXIT_PREEMPTED, Preempted  # noqa: F401 (re-exported)

_watch = {'fds': None, 'previous_fd': None, 'previous_handler': None, 'handled': 0}


def _handler(signum, frame):
    _watch['handled'] += 1
    previous = _watch['previous_handler']
    if callable(previous):
        return previous(signum, frame)
    raise KeyboardInterrupt


def watch_interrupts(grace=Timing.INTERRUPT_GRACE):
    """Make Ctrl-C stop this rank, and through it the job, even while it is blocked in a collective.

    :func:`~torchbearer_dist.launch` turns this on in every rank it starts; a program that runs one rank per
    process calls it once, from the main thread (it does nothing elsewhere, when SIGINT is ignored, or twice).

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.watch_interrupts()
        >>> tbd.unwatch_interrupts()

    Args:
        grace (float): seconds the main thread gets to handle KeyboardInterrupt by itself
    """
    if threading.current_thread() is not threading.main_thread() or _watch['fds'] is not None:
        return
    previous_handler = signal.getsignal(signal.SIGINT)
    if previous_handler in (signal.SIG_IGN, None):
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return
    signal.signal(signal.SIGINT, _handler)
    _watch.update(fds=(read_fd, write_fd), previous_fd=previous_fd, previous_handler=previous_handler, handled=0)
    threading.Thread(target=_wait_for_interrupt, args=(read_fd, write_fd, grace), name='torchbearer_dist-interrupt',
                     daemon=True).start()


def _wait_for_interrupt(read_fd, write_fd, grace):
    # On the wakeup fd: a Ctrl-C the main thread did not handle within `grace` (blocked in a collective) fails
    # this rank's collective, and one still not handled `grace` later (stuck in other native code) ends it.
    received = 0  # SIGINTs seen here: each is written before the main thread runs its handler, once
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT not in data:
            continue
        received += data.count(signal.SIGINT)
        time.sleep(grace)
        if _watch['fds'] != (read_fd, write_fd) or _watch['handled'] >= received:
            continue  # unwatched, or the main thread handled it (a handler of the program's may go on running)
        live = env._live
        sys.stderr.write('torchbearer_dist: rank {} interrupted inside a collective; stopping\n'.format(
            '?' if live is None else live.env.rank))
        sys.stderr.flush()
        if live is not None:  # why this rank stops is decided where every stop is (see _decision)
            live.interrupted()
        time.sleep(grace)
        if _watch['fds'] == (read_fd, write_fd) and _watch['handled'] < received:
            os._exit(130)


def unwatch_interrupts():
    """Undo :func:`watch_interrupts`: give SIGINT and the wakeup fd back as they were."""
    if _watch['fds'] is None or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = _watch['fds']
    _watch['fds'] = None
    try:
        signal.set_wakeup_fd(_watch['previous_fd'] if _watch['previous_fd'] is not None else -1)
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, _watch['previous_handler'])
    except ValueError:
        pass
    os.close(write_fd)
    os.close(read_fd)


_preemption = {'signals': (), 'previous': {}, 'requested': None, 'requeue': False, 'training': 0}


def _preemption_handler(signum, frame):
    # Repeated signals are normal (SLURM signals every process of a step, torchrun forwards its own
    # SIGTERM too): they only set the flag again. The scheduler's SIGKILL ends a rank that never stops.
    _preemption['requested'] = _preemption['requested'] or signal.Signals(signum).name
    previous = _preemption['previous'].get(signum)
    if callable(previous):  # the program's own handler (submitit's, Lightning's) runs too; SIG_DFL, SIG_IGN are not
        previous(signum, frame)
    if not threading.main_thread().is_alive():  # the program has ended and runs its exit handlers (torchrun's
        if previous in (signal.SIG_DFL, None):  # SIGTERM to a rank that exits): as before watch_preemption, no
            signal.signal(signum, signal.SIG_DFL)  # Preempted traceback from an atexit callback
            os.kill(os.getpid(), signum)
        return
    if not _preemption['training']:  # nothing training that could stop at a step boundary: stop now
        raise Preempted('pre-empted by {} outside training; resumable from the last checkpoint'.format(
            signal.Signals(signum).name))


def watch_preemption(signals=(signal.SIGTERM, signal.SIGUSR1), requeue=None):
    """Make a pre-emption signal stop training at the next step with a checkpoint, instead of killing it.

    Schedulers give notice before they take the machines back: SLURM sends SIGTERM (or, with
    ``--signal=USR1@60``, SIGUSR1 a minute before), torchrun forwards SIGTERM to its workers. Once this
    is on, such a signal only sets a flag while a Trial with a :class:`~torchbearer_dist.Checkpoint`
    callback trains: every rank agrees to stop at the next step boundary (through the stop agreement of
    :class:`~torchbearer_dist.AgreeOnStop`, no extra collective per step), global rank 0 writes a step
    checkpoint, and ``trial.run`` raises :class:`Preempted` on every rank: the process ends with status
    :data:`EXIT_PREEMPTED` (75). Outside training the handler raises :class:`Preempted` at once; once the
    program has ended (its exit handlers running) the signal does what it did without the watch.

    Opt-in for library use (:func:`~torchbearer_dist.launch`'s ranks and the examples turn it on). The
    handler calls the one it replaced first, where that is a function, and :func:`unwatch_preemption` puts
    it back. Call it from the main thread of every rank (it does nothing elsewhere, or twice).

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.watch_preemption()
        >>> tbd.unwatch_preemption()

    Args:
        signals (tuple): the signals that mean "pre-empted"
        requeue (bool): under SLURM, after the checkpoint is written, global rank 0 runs
            ``scontrol requeue $SLURM_JOB_ID`` so that the job starts again (the job needs ``--requeue``);
            None (the default) reads the environment variable ``TORCHBEARER_DIST_REQUEUE`` (``1``: requeue)
    """
    if threading.current_thread() is not threading.main_thread() or _preemption['signals']:
        return
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, _preemption_handler)
    if requeue is None:
        requeue = os.environ.get('TORCHBEARER_DIST_REQUEUE', '') == '1'
    _preemption.update(signals=tuple(signals), previous=previous, requested=None, requeue=bool(requeue))


def unwatch_preemption():
    """Undo :func:`watch_preemption`: give the signals their handlers back and forget a pending request."""
    if not _preemption['signals'] or threading.current_thread() is not threading.main_thread():
        return
    for s, previous in _preemption['previous'].items():
        if signal.getsignal(s) is _preemption_handler:
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
    _preemption.update(signals=(), previous={}, requested=None, requeue=False)


def preemption_requested():
    """The name of the pre-emption signal received (``'SIGTERM'``, ...) while watching, or None."""
    return _preemption['requested']


def forget_preemption():
    """Clear the request once it has been acted on (the checkpoint written), so that a later run trains."""
    _preemption['requested'] = None


def training(active):
    """Say that a Trial starts (True) or ends (False) training with a checkpoint ready to take a pre-emption."""
    _preemption['training'] = max(0, _preemption['training'] + (1 if active else -1))


def requeue_slurm_job():
    """Under SLURM, where :func:`watch_preemption` was asked to: ``scontrol requeue $SLURM_JOB_ID``.

    Returns:
        bool: True if the job was requeued
    """
    job = os.environ.get('SLURM_JOB_ID')
    if not _preemption['requeue'] or not job:
        return False
    import subprocess
    try:
        done = subprocess.run(['scontrol', 'requeue', job], capture_output=True, text=True,
                              timeout=Timing.REQUEUE_CALL)
        why = done.stderr.strip() if done.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as error:
        why = error
    if why is not None:
        sys.stderr.write('torchbearer_dist: scontrol requeue {} failed: {}\n'.format(job, why))
    return why is None
