"""Ctrl-C for programs that own their process: the launcher's ranks and the example's command line.

Opt-in: nothing here runs unless :func:`watch_interrupts` is called. Library use
(:func:`~torchbearer_dist.init_process_group` in a user's script or notebook) leaves SIGINT's handler
and the wakeup fd alone, so asyncio and Jupyter keep theirs.

Python runs signal handlers only between bytecodes, so a rank blocked in a gloo collective ignores
SIGINT until the collective ends (up to the collective timeout). A helper thread sees the signal
through :func:`signal.set_wakeup_fd`; if the main thread has not started handling it ``grace``
seconds later, the thread publishes the interrupt as this rank's cause and makes the collective
fail, so that the main thread raises KeyboardInterrupt and unwinds normally (``finally`` blocks
run). Only if it is still stuck another ``grace`` later (in native code that is no collective) does
the thread end the process with status 130.
"""
import os
import signal
import sys
import threading
import time

from torchbearer_dist.runtime import _diagnosis, group
from torchbearer_dist.runtime.env import current_env, current_store

_watch = {'fds': None, 'previous_fd': None, 'previous_handler': None, 'handled': 0}


def _handler(signum, frame):
    _watch['handled'] += 1
    previous = _watch['previous_handler']
    if callable(previous):
        return previous(signum, frame)
    raise KeyboardInterrupt


def watch_interrupts(grace=2.0):
    """Make Ctrl-C stop this rank, and through it the job, even while it is blocked in a collective.

    The launcher (:func:`~torchbearer_dist.launch`) turns this on in every rank it starts; a command
    line program that runs one rank per process calls it once at start-up. Call it from the main
    thread; it does nothing elsewhere, when SIGINT is ignored, or twice.

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
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT not in data:
            continue
        handled = _watch['handled']
        time.sleep(grace)
        if _watch['fds'] != (read_fd, write_fd) or _watch['handled'] > handled:
            continue  # unwatched, or the main thread is handling it
        env, store = current_env(), current_store()
        sys.stderr.write('torchbearer_dist: rank {} interrupted inside a collective; stopping\n'.format(
            '?' if env is None else env.rank))
        sys.stderr.flush()
        if env is not None and env.world_size > 1:
            _diagnosis.publish(store, _diagnosis.Cause(env.rank, _diagnosis.LOCAL, 'KeyboardInterrupt',
                                                     'interrupted (SIGINT)'))
            group.interrupt_collectives(env)
        time.sleep(grace)
        if _watch['fds'] == (read_fd, write_fd) and _watch['handled'] == handled:
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
