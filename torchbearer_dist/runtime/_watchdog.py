"""Notice a dead or silent peer in seconds, whatever the collective timeout.

A helper thread of each rank beats a counter in the job's store every second (four times per
rendezvous timeout where that is shorter than 4 s), over its own store connection. Rank 0 watches
every rank's counter, the others watch rank 0's and the store itself. A counter seen unchanged for
the rendezvous timeout, or a store that stops answering, ends the job with a ``network`` (or
``peer``) cause; a cause published by any rank ends it too. Ending means: publish
the cause, then wake this rank's main thread from the collective it is blocked in (a callback given
by :mod:`torchbearer_dist.runtime.group`). The collective timeout can therefore be long, as torch's is: a
rank busy for minutes between collectives (rank-0-only work) keeps beating and is never mistaken
for a dead one.

A rank that did not run for a while (stopped by Ctrl-Z or ``kill -STOP``, its machine paused, its
main thread holding the GIL in one native call) judges nobody by what it read before: when the pause
outlasted the rendezvous timeout, what it then finds wrong is its own pause, and it says so.
"""
import threading
import time

from torchbearer_dist.runtime import _diagnosis, _verdict

_INTERVAL = 1.0
#: Beats per rendezvous timeout, at least: a beat that falls late under load is not yet a silence.
_BEATS_PER_LIMIT = 4


class Watchdog:
    """The heartbeat of one rank, and its watch over the others.

    Two daemon threads: one makes the store calls (a call to a silent host can block past any
    timeout), the other judges how long ago they last succeeded, so a blocked call is noticed too.
    Both only sample and apply: the judgement is :func:`~torchbearer_dist.runtime._verdict.judge`.

    Args:
        env (DistEnv): this process's place in the job
        store (torch.distributed.Store): a connection to the job's store for these threads alone
        on_failure (callable): called once, from a thread, with the :class:`~_diagnosis.Cause` (None
            when another rank's cause is already in the store) and whether the store still answers,
            so that the cause can be published there
        interval (float): seconds between beats, at most; shorter where the rendezvous timeout is
            under :data:`_BEATS_PER_LIMIT` of them
        dead_ranks (callable): the local peer ranks whose process is gone (the live group passes
            :func:`torchbearer_dist.runtime._peers.dead_local_ranks` of its peers); by default none
    """

    def __init__(self, env, store, on_failure, interval=_INTERVAL, dead_ranks=None):
        limit = env.meet_timeout.total_seconds()
        self.env, self.store, self.on_failure = env, store, on_failure
        self.interval = min(interval, limit / _BEATS_PER_LIMIT)
        self._dead_ranks = dead_ranks or frozenset
        watched = range(env.world_size) if env.rank == 0 else [0]
        self.limits = _verdict.Limits(env.rank, tuple(r for r in watched if r != env.rank), limit)
        now = time.monotonic()
        self._seen = _verdict.Sample(now, now)  # the last store round that succeeded
        self._failed = (float('-inf'), 0)  # when a store round last failed, and how many in a row
        self._memory = _verdict.start(now)  # replaced by the watch thread at each wake-up
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name='torchbearer_dist-heartbeat', daemon=True),
                         threading.Thread(target=self._watch, name='torchbearer_dist-watchdog', daemon=True)]

    def start(self):
        """Start beating and watching."""
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, wait=0.5):
        """Stop both threads, waiting ``wait`` seconds at most; :meth:`join` waits for the rest.

        A failing rank reports its cause without waiting for a store call blocked on a silent host.
        """
        self._stop.set()
        self.join(wait)

    def running(self):
        """Whether a thread is still alive, e.g. inside a store call after :meth:`stop`."""
        return any(thread.is_alive() for thread in self._threads)

    def join(self, seconds=None):
        """Wait until both threads have ended, that is until a store call in flight has returned.

        A daemon thread still inside a torch call when the interpreter finalizes aborts the whole
        process as that call returns ("terminate called without an active exception", exit code
        134: pytest itself aborted so when only :meth:`stop` waited, see tests/runtime/test_group_safety.py). The
        wait is bounded by the store's own timeout: only a call to a silent host that never returns
        is left behind.

        Args:
            seconds (float): the most to wait for each thread; by default that bound
        """
        if seconds is None:
            seconds = self.store.timeout.total_seconds() + self.interval + 1.0
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(seconds)

    def frozen_cause(self):
        """The :class:`~_diagnosis.Cause` naming this rank when it has just been paused for longer than
        the rendezvous timeout (its peers then took it for lost), else None.

        Also right after the pause, before the watch thread has run again: its last wake-up is then
        older than the limit.
        """
        seconds = _verdict.paused(self._memory, time.monotonic(), self.limits)
        return None if seconds is None else _diagnosis.frozen(self.env.rank, seconds, self.limits.limit)

    def silence(self):
        """Seconds the longest-silent watched peer's beat has been seen unchanged, or None (see
        :func:`~torchbearer_dist.runtime._verdict.silence`): how a collective failed, from the heartbeat."""
        return _verdict.silence(self._memory, time.monotonic())

    def _beat(self):
        store, keys = self.store, ['hb/{}'.format(r) for r in self.limits.watched]
        while not self._stop.wait(self.interval):
            began = time.monotonic()
            try:
                store.add('hb/{}'.format(self.env.rank), 1)
                error = store.check(['error'])
                values = tuple(int(v) for v in store.multi_get(keys)) if keys else ()
            except Exception:
                self._failed = (time.monotonic(), self._failed[1] + 1)
                continue
            self._failed = (self._failed[0], 0)
            self._seen = _verdict.Sample(began, time.monotonic(), error, values)

    def _watch(self):
        # Sample four times per beat, judge (a pure function, see _verdict), apply. The local peers are
        # read before the clock: a peer seen gone at `now` surely went before it (and marked itself left
        # before that, if it did), so a round begun after `now` reads its leave mark.
        while not self._stop.wait(self.interval / 4):
            dead = frozenset(self._dead_ranks())
            now = time.monotonic()
            failed, failures = self._failed
            seen = _verdict.Observation(now, self._seen, failed, failures, dead)
            self._memory, verdict = _verdict.judge(self._memory, seen, self.limits)
            if verdict is not None:
                if not self._stop.is_set():
                    self.on_failure(_diagnosis.cause_of(verdict, self.env), verdict.store_answers)
                return
