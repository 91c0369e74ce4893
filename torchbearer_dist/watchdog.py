"""Notice a dead or silent peer in seconds, whatever the collective timeout.

A helper thread of each rank beats a counter in the job's store every second, over its own store
connection. Rank 0 watches every rank's counter, the others watch rank 0's and the store itself. A
counter that stops for the rendezvous timeout, or a store that stops answering, ends the job with a
``network`` (or ``peer``) cause; a cause published by any rank ends it too. Ending means: publish
the cause, then wake this rank's main thread from the collective it is blocked in (a callback given
by :mod:`torchbearer_dist.group`). The collective timeout can therefore be long, as torch's is: a
rank busy for minutes between collectives (rank-0-only work) keeps beating and is never mistaken
for a dead one.
"""
import threading
import time

from torchbearer_dist import diagnosis

_INTERVAL = 1.0


class Watchdog:
    """The heartbeat of one rank, and its watch over the others.

    Args:
        env (DistEnv): this process's place in the job
        store (torch.distributed.Store): a connection to the job's store for this thread alone
        on_failure (callable): called once, from the thread, with the :class:`~diagnosis.Cause`
        interval (float): seconds between beats
    """

    def __init__(self, env, store, on_failure, interval=_INTERVAL):
        self.env, self.store, self.on_failure, self.interval = env, store, on_failure, interval
        self.limit = env.meet_timeout.total_seconds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='torchbearer_dist-watchdog', daemon=True)

    def start(self):
        """Start beating and watching."""
        self._thread.start()
        return self

    def stop(self):
        """Stop, waiting at most one interval and a bit for the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + 2.0)

    def _run(self):
        env, store = self.env, self.store
        watched = list(range(env.world_size)) if env.rank == 0 else [0]
        watched = [r for r in watched if r != env.rank]
        keys = ['hb/{}'.format(r) for r in watched]
        last, changed = {}, {}
        reached = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                store.add('hb/{}'.format(env.rank), 1)
                if store.check(['error']):
                    self._fail(None)
                    return
                values = store.multi_get(keys) if keys else []
            except Exception:
                if env.rank != 0 and now - reached > self.limit:
                    self._fail(diagnosis.master_silent(env, self.limit))
                    return
                continue
            reached = now
            for rank, value in zip(watched, values):
                if last.get(rank) != value:
                    last[rank], changed[rank] = value, now
                elif now - changed[rank] > self.limit:
                    self._fail(diagnosis.no_heartbeat(rank, self.limit))
                    return

    def _fail(self, cause):
        if not self._stop.is_set():
            self.on_failure(cause)
