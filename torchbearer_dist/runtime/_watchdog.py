"""Notice a dead or silent peer in seconds, whatever the collective timeout.

A helper thread of each rank beats a counter in the job's store over its own connection, from before the
handshake. Rank 0 watches every rank's counter once all have joined, the others rank 0's and the store itself;
the live group folds what :func:`~._decision.judge` found and wakes the main thread. A rank busy for
minutes between collectives keeps beating, so the collective timeout can stay long, as torch's is.
"""
import threading
import time
from dataclasses import replace

from torchbearer_dist.runtime import _decision
from torchbearer_dist.runtime._timing import Timing


class Watchdog:
    """The heartbeat of one rank, and its watch over the others.

    Two daemon threads: one makes the store calls (a call to a silent host can block past any timeout), the
    other judges how long ago they last succeeded, so a blocked call is noticed too. Both only sample and
    apply: the judgement is :func:`~torchbearer_dist.runtime._decision.judge`.

    Args:
        env (DistEnv): this process's place in the job
        store (torch.distributed.Store): a connection to the job's store for these threads alone
        on_failure (callable): called once, from a thread, with the :class:`~_diagnosis.Cause` (None when
            another rank's is in the store) and whether the store still answers, to publish it there
        interval (float): seconds between beats, at most; by default :class:`~._timing.Timing`'s ``beat``
        dead_ranks (callable): the local peer ranks whose process is gone; by default none
        peers (bool): watch the other ranks' beats from the start; False (before the handshake, when they may
            not beat yet) watches only that the store answers, until :meth:`watch_peers`
    """

    def __init__(self, env, store, on_failure, interval=None, dead_ranks=None, peers=True):
        timing = Timing.of(env)
        self.env, self.store, self.on_failure = env, store, on_failure
        self.interval = timing.beat if interval is None else min(interval, timing.beat)
        self._dead_ranks = dead_ranks or frozenset
        watched = range(env.world_size) if env.rank == 0 else [0]
        self._peers = tuple(r for r in watched if r != env.rank)
        self.limits = _decision.Limits(env.rank, self._peers if peers else (), timing.limit)
        now = time.monotonic()
        self._seen = _decision.Sample(now, now)  # the last store round that succeeded
        self._failed = (float('-inf'), 0)  # when a store round last failed, and how many in a row
        self.memory = _decision.start(now)  # replaced at each wake-up; the live group folds it into every event
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name='torchbearer_dist-heartbeat', daemon=True),
                         threading.Thread(target=self._watch, name='torchbearer_dist-watchdog', daemon=True)]

    def start(self):
        """Start beating and watching."""
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, wait=Timing.WATCH_STOP):
        """Stop both threads, waiting ``wait`` seconds at most (not for a store call blocked on a silent host);
        :meth:`join` waits for the rest."""
        self._stop.set()
        self.join(wait)

    def running(self):
        """Whether a thread is still alive, e.g. inside a store call after :meth:`stop`."""
        return any(thread.is_alive() for thread in self._threads)

    def join(self, seconds=None):
        """Wait until both threads have ended (a daemon thread inside a torch call when the interpreter finalizes
        aborts the process), ``seconds`` each, by default the store's own timeout, a beat and a second."""
        seconds = self.store.timeout.total_seconds() + self.interval + Timing.WATCH_JOIN if seconds is None else seconds
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(seconds)

    def watch_peers(self):
        """Watch the other ranks' beats from now on (rank 0 every rank's, the others rank 0's): they all joined."""
        self.limits = replace(self.limits, watched=self._peers)

    def _beat(self):
        store = self.store
        while not self._stop.wait(self.interval):
            keys = ['hb/{}'.format(r) for r in self.limits.watched]  # judged with these limits, or read nothing
            began = time.monotonic()
            try:
                store.add('hb/{}'.format(self.env.rank), 1)
                error = store.check(['error'])
                values = tuple(int(v) for v in store.multi_get(keys)) if keys else ()
            except Exception:
                self._failed = (time.monotonic(), self._failed[1] + 1)
                continue
            self._failed = (self._failed[0], 0)
            self._seen = _decision.Sample(began, time.monotonic(), error, values)

    def _watch(self):
        # Sample four times per beat, judge (a pure function, see _decision), apply. The local peers are
        # read before the clock: a peer seen gone at `now` surely went before it (and marked itself left
        # before that, if it did), so a round begun after `now` reads its leave mark.
        while not self._stop.wait(self.interval / Timing.SAMPLES_PER_BEAT):
            dead = frozenset(self._dead_ranks())
            now = time.monotonic()
            seen = _decision.Observation(now, self._seen, *self._failed, dead)
            self.memory, verdict = _decision.judge(self.memory, seen, self.limits)
            if verdict is not None:
                if not self._stop.is_set():
                    self.on_failure(_decision.cause_of(verdict, self.env), verdict.store_answers)
                return
