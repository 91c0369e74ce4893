"""(private) Ctrl-C and SIGTERM end a replica of the fault-tolerant mode at once, wherever they land.

torchft swallows what the main thread raises inside it: a callback of one of its futures turns the exception
into the future's RuntimeError, which ``Manager.wrap_future`` logs (a 20 to 60 line traceback) and reports as
the step's error, and the replica trained on to the end of its run. Its gloo and Rust calls block without
running Python's signal handlers, and at exit Python waits for its quorum thread, which may be in a Rust call
for three timeouts, then for its native teardown.

So while a run of :class:`~torchbearer_dist.FaultTolerantAllReduce` is active, :class:`SignalStop` takes SIGINT
and SIGTERM (where they are not ignored), and puts back the handlers it found when the run ends. A signal:

- is seen at once by a helper thread, on the wakeup fd (forwarded to the one it replaced, if any), which notes
  where the replica was (in training: the epoch and batch) and whether a checkpoint was written, and quietens
  torchft's loggers and Python's warnings (the replica is ending: a swallowed stop is no step error);
- in the main thread, at its next Python instruction, runs the handler the program had, if it set one (its
  flag, its requeue; what it raises gives way), writes the one line and raises :class:`Stopped` (SIGTERM) or
  :class:`Interrupted` (SIGINT: also a ``KeyboardInterrupt``): the program's ``finally`` blocks and ``except
  KeyboardInterrupt`` run; when the program ends, the process ends at once with status 128 + the signal's
  number, no traceback (uncaught, a :class:`SystemExit`), before Python would wait for torchft's threads;
  where Python drops it (the signal landed in a ``__del__``, a weakref or GC callback: Python would print a
  traceback and go on), the helper signals the main thread again, and it is raised at its next instruction;
- where torchft swallowed it, the step it failed raises it again in the main thread (see
  :meth:`SignalStop.raise_taken`), and no other line is said after it;
- if the process has not ended :data:`GRACE` seconds after the signal (swallowed, stuck in native code), the
  helper writes the line (once) and ends it with that status.

A second SIGINT or SIGTERM during the grace ends the process at once. The status is the one a shell shows for
a process the signal killed (130, 143), whichever way it ends; the helper's end skips exit handlers.
"""
import atexit
import functools
import logging
import os
import select
import signal
import sys
import threading
import time
import warnings
import weakref

import torchbearer

from torchbearer_dist import _torchbearer
from torchbearer_dist.checkpoint.callback import WRITER, Checkpoint
from torchbearer_dist.ft._events import PREFIX
from torchbearer_dist.runtime._timing import Timing

#: Seconds after a signal by which the replica has ended: its main thread's unwinding, or the helper's end.
GRACE = Timing.REPLICA_STOP_GRACE
#: Seconds between the helper's looks, during the grace, at whether the main thread dropped its stop.
DROPPED_POLL = 0.005
#: The signals that end a replica.
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: torchft's Python loggers, silenced once a replica is ending.
LOGGERS = ('torchft', 'torchft_quorums', 'torchft_commits', 'torchft_errors')


class Stopped(SystemExit):
    """A replica of the fault-tolerant mode ended by a signal; uncaught, the process exits with 128 + its number.

    Attributes:
        signum (int): the signal
        message (str): the line written on stderr when the signal was taken
    """

    def __init__(self, message, signum):
        super().__init__(128 + signum)
        self.message, self.signum = message, signum

    def __str__(self):
        return self.message


class Interrupted(Stopped, KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended a replica: a :class:`Stopped`, and a ``KeyboardInterrupt`` for the program's own
    ``except KeyboardInterrupt``; uncaught, the process exits with status 130 and no traceback."""


def stop_line(replica_id, signum, where, checkpoint):
    """The one line a replica ended by ``signum`` writes, from what was observed when the signal was taken.

    Args:
        replica_id (str): the replica's name
        signum (int): the signal
        where (dict): ``training`` (bool), ``epoch``, ``epochs``, ``batch``, ``batches`` (1-based; None where
            unknown), ``validating`` (bool), ``started`` (whether a batch of the run was begun)
        checkpoint (dict): ``path`` (None: no :class:`~torchbearer_dist.Checkpoint` configured), ``age`` (seconds
            since its file was written, None: no file), ``writer`` (False: another replica writes them)

    Returns:
        str: e.g. ``replica r1 stopped by SIGTERM in epoch 2 of 3, batch 15 of 60; no checkpoint (no
        torchbearer_dist.Checkpoint is configured)``, without the ``torchbearer_dist:`` prefix
    """
    if where['training'] and where['batch'] is not None:
        at = 'in epoch {epoch} of {epochs}, batch {batch} of {batches}'.format(**where)
    elif where['validating']:
        at = 'in epoch {epoch} of {epochs}, validating'.format(**where)
    elif not where['started']:
        at = 'before training its first batch (joining the replicas, healing if behind)'
    else:
        at = 'between the passes of epoch {epoch} of {epochs} (not in a training step)'.format(**where)
    if checkpoint['path'] is None:
        saved = 'no checkpoint (no torchbearer_dist.Checkpoint is configured)'
    elif checkpoint['age'] is not None:
        saved = 'its checkpoint {} was written {:.1f} s before'.format(checkpoint['path'], checkpoint['age'])
    elif checkpoint['writer'] is False:
        saved = 'no checkpoint written here ({}): another replica writes them'.format(checkpoint['path'])
    else:
        saved = 'no checkpoint written yet (torchbearer_dist.Checkpoint writes {})'.format(checkpoint['path'])
    return 'replica {} stopped by {} {}; {}'.format(replica_id, signal.Signals(signum).name, at, saved)


def observe(state, training, now):
    """Where the run whose Trial state is ``state`` is, and its checkpoint, as :func:`stop_line` takes them.

    Args:
        state (torchbearer.State): the run's state, or None
        training (bool): whether a training pass is under way (between ``on_start_training`` and
            ``on_end_training``)
        now (float): ``time.time()``

    Returns:
        tuple: ``(where, checkpoint)``
    """
    state = state if state is not None else {}
    started = torchbearer.BATCH in state
    batch = state.get(torchbearer.BATCH)
    where = {'training': training, 'epoch': state.get(torchbearer.EPOCH, 0) + 1,
             'epochs': state.get(torchbearer.MAX_EPOCHS), 'batch': batch + 1 if training and started else None,
             'batches': state.get(torchbearer.STEPS), 'started': started,
             'validating': not training and started and state.get(torchbearer.DATA) == torchbearer.VALIDATION_DATA}
    keepers = []
    if state.get(torchbearer.CALLBACK_LIST) is not None:
        keepers = [c for c in _torchbearer.callback_list(state[torchbearer.CALLBACK_LIST]) if isinstance(c, Checkpoint)]
    checkpoint = {'path': keepers[0].path if keepers else None, 'age': None, 'writer': state.get(WRITER)}
    if keepers:
        try:
            checkpoint['age'] = max(0.0, now - os.stat(keepers[0].path).st_mtime)
        except OSError:
            pass
    return where, checkpoint


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a stream closed, or one the interrupted code was writing
            pass


class SignalStop:
    """SIGINT and SIGTERM end this replica within :data:`GRACE` seconds while it is open (see the module).

    Opened from the main thread (elsewhere it does nothing: Python runs signal handlers there only); a signal
    ignored when it opens (``SIG_IGN``, as in a background job of a shell) stays ignored. Closed by
    :meth:`close`, or when the run's state is freed.

    Args:
        replica_id (str): the replica's name, in its line
        where (callable): returns ``(state, training)``: the run's Trial state (or None) and whether a
            training pass is under way
    """

    def __init__(self, replica_id, where):
        self.replica_id, self._where = replica_id, where
        self.signum, self.line = None, None  # the first signal taken, and its line
        self._lock, self._written, self._open = threading.Lock(), False, False
        self._chained, self._dropped, self._echoes = False, False, 0  # see _handle, _unraisable and _watch
        self._handler = self._handle  # one bound method: the one installed, compared at close
        self._previous, self._fds, self._previous_fd = {}, None, None
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = {s: signal.getsignal(s) for s in SIGNALS}
        self._previous = {s: h for s, h in self._previous.items() if h not in (signal.SIG_IGN, None)}
        if not self._previous:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(read_fd)
            os.close(write_fd)
            return
        for s in self._previous:
            signal.signal(s, self._handler)
        self._fds, self._open = (read_fd, write_fd), True
        state = where()[0]
        if state is not None:  # a run that raised before its callback could release it: closed with its state
            weakref.finalize(state, self.close)
        threading.Thread(target=self._watch, args=(read_fd,), name='torchbearer_dist-replica-signals',
                         daemon=True).start()

    def close(self):
        """Put back the handlers and the wakeup fd found at the start; idempotent. After a signal it does nothing:
        the replica is ending."""
        if not self._open or self.signum is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            self._open = False  # the handlers stay, and act as those they replaced (see _handle)
            return
        self._open = False
        try:
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        except (ValueError, OSError):  # the fd it replaced was closed meanwhile
            signal.set_wakeup_fd(-1)
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handler:
                signal.signal(s, previous)
        os.close(self._fds[1])  # the helper reads the end of its pipe, closes it and ends

    def _handle(self, signum, frame):
        previous = self._previous.get(signum)
        if not self._open and self.signum is None:  # closed from another thread: as the handler it replaced
            if callable(previous):
                return previous(signum, frame)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._take(signum)
        chained, self._chained = self._chained, True  # once: a stop raised again (see _unraisable) is not a signal
        if not chained and callable(previous) and previous is not signal.default_int_handler:
            try:
                previous(signum, frame)  # the program's own: its flag, its requeue
            except BaseException:  # e.g. watch_preemption's Preempted: this replica's stop says more
                pass
        self.raise_taken()

    def raise_taken(self):
        """Raise the stop of the signal taken, if there was one: where torchft swallowed it (a future's callback
        turned it into the step's error), the main thread raises it again as it sees that error.

        Raises:
            Stopped: (:class:`Interrupted` for SIGINT) after the line is written, once
        """
        if self.signum is None:
            return
        self._write()
        raise (Interrupted if self.signum == signal.SIGINT else Stopped)(self.line, self.signum)

    def _take(self, signum):
        """Note the first signal and where the replica was; quieten torch and torchft; end the process where the
        program ends. True for the first."""
        with self._lock:
            if self.signum is not None:
                return False
            try:
                state, training = self._where()
                where, checkpoint = observe(state, training, time.time())
                line = stop_line(self.replica_id, signum, where, checkpoint)
            except Exception as e:  # the state mid-change: say what is known, never fail to stop
                line = 'replica {} stopped by {} ({}: {})'.format(self.replica_id, signal.Signals(signum).name,
                                                                  type(e).__name__, e)
            self.signum, self.line = signum, line
        for name in LOGGERS:  # what torchft's threads log of the stop (a step error, a heal cut short)
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
        warnings.simplefilter('ignore')  # torch's, from torchft's thread (a heal's buffer)
        sys.unraisablehook = functools.partial(self._unraisable, sys.unraisablehook)
        try:  # called before Python joins its threads at exit: torchft's quorum thread may be in a Rust call
            threading._register_atexit(self._at_exit)
        except (AttributeError, RuntimeError):  # another Python; or the program's end has begun: the helper ends it
            atexit.register(self._at_exit)
        return True

    def _unraisable(self, hook, unraisable):
        """A stop raised where Python drops what is raised and prints it (a ``__del__``, a weakref or GC callback:
        the signal landed there) is raised again, without that traceback: the helper signals the main thread again
        once this call has returned (see _watch). Anything else goes to ``hook``, the one this replaced."""
        if not isinstance(unraisable.exc_value, Stopped) or self.signum is None:
            return hook(unraisable)
        self._dropped = True  # the last instruction: no signal or other thread runs before this call returns

    def _write(self, flush=True):
        """The line, once, after what the program wrote before it."""
        with self._lock:
            if self._written:
                return
            self._written = True
        if flush:
            _flush()
        os.write(2, (PREFIX + self.line + '\n').encode(errors='replace'))

    def _end(self, bounded=True):
        """End the process: its output flushed (``bounded``: for 0.25 s at most, from another thread, as a main
        thread stuck inside a write to a full pipe holds its stream), the line written, status 128 + the signal."""
        if bounded:
            flusher = threading.Thread(target=_flush, name='torchbearer_dist-replica-flush', daemon=True)
            flusher.start()
            flusher.join(0.25)
        else:
            _flush()
        self._write(flush=False)
        os._exit(128 + self.signum)

    def _at_exit(self):
        # A stop unwound to the end of the program: end now. Python's own end would wait for torchft's quorum
        # thread (in a Rust call for up to three timeouts), then seconds for its native teardown (its Rust
        # runtime, the gloo group), where no Python thread runs any more.
        self._end(bounded=False)

    def _watch(self, read_fd):
        """The helper thread: every signal byte of the wakeup fd, forwarded; after the first SIGINT or SIGTERM,
        the end of the process at the grace's end, or at a second one."""
        deadline = None
        while True:
            wait = None if deadline is None else max(0.0, min(deadline - time.monotonic(), DROPPED_POLL))
            try:
                ready = select.select([read_fd], [], [], wait)[0]
                data = os.read(read_fd, 64) if ready else None
            except OSError:
                data = b''
            if self._dropped:  # the main thread dropped its stop (see _unraisable): it takes it again
                self._dropped, self._echoes = False, self._echoes + 1  # that signal is no second one
                signal.pthread_kill(threading.main_thread().ident, self.signum)
            if data is None and time.monotonic() < deadline:
                continue
            if data is None:  # the grace is over: the main thread did not end the process
                self._end()
            if not data:  # closed: the run ended, or this thread is all that is left of a stop
                if deadline is None:
                    os.close(read_fd)
                    return
                time.sleep(max(0.0, deadline - time.monotonic()))
                self._end()
            for signum in [s for s in data if s in SIGNALS][:self._echoes]:  # the signals this thread sent
                data, self._echoes = data.replace(bytes([signum]), b'', 1), self._echoes - 1
            previous = self._previous_fd
            if data and previous is not None and previous >= 0:
                try:
                    os.write(previous, data)  # the wakeup fd this one replaced (watch_interrupts', asyncio's)
                except OSError:
                    pass
            if not self._open:
                continue
            for signum in data:
                if signum not in SIGNALS:
                    continue
                if deadline is not None:
                    self._end()  # a second signal: now
                self._take(signum)
                deadline = time.monotonic() + GRACE
