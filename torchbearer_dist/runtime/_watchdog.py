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

from torchbearer_dist.runtime import _diagnosis, _peers

_INTERVAL = 1.0
#: Beats per rendezvous timeout, at least: a beat that falls late under load is not yet a silence.
_BEATS_PER_LIMIT = 4
#: Added to a rank's heartbeat counter when it leaves the job cleanly: from then on it is not watched.
LEFT = 1 << 40


class Watchdog:
    """The heartbeat of one rank, and its watch over the others.

    Two daemon threads: one makes the store calls (a call to a silent host can block past any
    timeout), the other judges how long ago they last succeeded, so a blocked call is noticed too.

    Args:
        env (DistEnv): this process's place in the job
        store (torch.distributed.Store): a connection to the job's store for these threads alone
        on_failure (callable): called once, from a thread, with the :class:`~_diagnosis.Cause` (None
            when another rank's cause is already in the store) and whether the store still answers,
            so that the cause can be published there
        interval (float): seconds between beats, at most; shorter where the rendezvous timeout is
            under :data:`_BEATS_PER_LIMIT` of them
    """

    def __init__(self, env, store, on_failure, interval=_INTERVAL):
        self.limit = env.meet_timeout.total_seconds()
        self.env, self.store, self.on_failure = env, store, on_failure
        self.interval = min(interval, self.limit / _BEATS_PER_LIMIT)
        watched = list(range(env.world_size)) if env.rank == 0 else [0]
        self.watched = [r for r in watched if r != env.rank]
        now = time.monotonic()
        self._seen = (now, now, False, None)  # last success: began, ended, error published, heartbeat values
        self._failed = 0.0  # when a store round last failed
        self.awake = now  # when the watch thread last ran
        self._frozen = None  # (seconds, when) of the last pause of this process longer than the limit
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
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(wait)

    def running(self):
        """Whether a thread is still alive, e.g. inside a store call after :meth:`stop`."""
        return any(thread.is_alive() for thread in self._threads)

    def join(self):
        """Wait until both threads have ended, that is until a store call in flight has returned.

        A daemon thread still inside a torch call when the interpreter finalizes aborts the whole
        process as that call returns ("terminate called without an active exception", exit code
        134: pytest itself aborted so when only :meth:`stop` waited, see tests/runtime/test_group_safety.py). The
        wait is bounded by the store's own timeout: only a call to a silent host that never returns
        is left behind.
        """
        bound = self.store.timeout.total_seconds() + self.interval + 1.0
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(bound)

    def frozen_cause(self):
        """The :class:`~_diagnosis.Cause` naming this rank when it has just been paused for longer than
        the rendezvous timeout (its peers then took it for lost), else None.

        Also right after the pause, before the watch thread has run again: its last wake-up is then
        older than the limit.
        """
        now = time.monotonic()
        if now - self.awake > self.limit:
            return _diagnosis.frozen(self.env.rank, now - self.awake, self.limit)
        if self._frozen is not None and now - self._frozen[1] <= self.limit:
            return _diagnosis.frozen(self.env.rank, self._frozen[0], self.limit)
        return None

    def _beat(self):
        store, keys = self.store, ['hb/{}'.format(r) for r in self.watched]
        while not self._stop.wait(self.interval):
            began = time.monotonic()
            try:
                store.add('hb/{}'.format(self.env.rank), 1)
                error = store.check(['error'])
                values = store.multi_get(keys) if keys else []
            except Exception:
                self._failed = time.monotonic()
                continue
            self._seen = (began, time.monotonic(), error, values)

    def _watch(self):
        # A counter is sampled every interval. The silence is counted from the sample that saw its
        # last change: that beat surely came no earlier, so a peer named silent for the limit was
        # silent at least that long. Counted from the sample before (the earliest the beat could have
        # come), a peer beating a little slower than it is sampled, as a busy rank 0 does, was named
        # silent whenever one sample window held no beat: 1 healthy job in 30 under load, measured.
        # The price is a peer named up to one interval after the limit. Judged four times per beat.
        # A wake-up gap of half the limit means this process did not run (a thread of a loaded machine
        # waits far less): what was read before is not judged, and silences count from the first
        # round begun after it. A gap of a beat or two is not a pause: resetting the silences then
        # let a loaded rank 0 never name a stopped peer.
        last, changed, sample, dead, resumed = {}, {}, None, {}, self.awake
        while not self._stop.wait(self.interval / 4):
            now = time.monotonic()
            gap, self.awake = now - self.awake, now
            if gap > self.limit / 2:
                last, changed, resumed = {}, {}, now
                if gap > self.limit:
                    self._frozen = (gap, now)
            for rank in _peers.dead_local_ranks():
                dead.setdefault(rank, now)
            began, reached, error, values = self._seen
            if error:
                return self._fail(None, True)
            # silent, or gone while this rank did not run (then _fail names the pause)
            if self.env.rank != 0 and (now - max(reached, resumed) > self.limit or
                                       self._failed > resumed and self.frozen_cause() is not None):
                return self._fail(_diagnosis.master_silent(self.env, self.limit), False)
            if values is None or reached == sample or began < resumed:
                continue
            sample = reached
            for rank, value in zip(self.watched, values):
                if int(value) >= LEFT:
                    continue
                # gone while still beating, and not marked left after it was seen gone: killed or crashed.
                # One whose beats had stopped before (cut off from the store, it gave up on rank 0) is
                # named below for its silence, as a host cut off from this one is.
                if rank in dead and reached > dead[rank] and dead[rank] - changed.get(rank, now) <= self.limit / 2:
                    return self._fail(_diagnosis.died([rank]), rank != 0)  # rank 0 held the store
                if last.get(rank) != value:
                    last[rank], changed[rank] = value, reached
                elif reached - changed[rank] > self.limit:
                    return self._fail(_diagnosis.no_heartbeat(rank, self.limit), True)

    def _fail(self, cause, store_answers):
        if cause is not None:  # what goes wrong right after a long pause of this rank is that pause
            cause = self.frozen_cause() or cause
        if not self._stop.is_set():
            self.on_failure(cause, store_answers)
