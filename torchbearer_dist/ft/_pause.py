"""(private) How long this whole process was stopped: SIGSTOP, a paused VM, a machine swapping.

A replica stopped past the lighthouse's heartbeat timeout is left out by the others; when it goes on and
finds nobody at the lighthouse (they finished or were lost meanwhile), it must not train on alone from
where it was. Only a thread that kept running can tell it was stopped: this one wakes every :data:`TICK`
seconds and keeps the longest gap past its tick.
"""
import threading
import time

#: Seconds between the clock's wakes.
TICK = 0.25
#: A gap past the tick longer than this counts as the process having been stopped: above a loaded machine's
#: scheduling delays, under the lighthouse's default heartbeat timeout (5 s), after which the others go on.
STOPPED = 3.0


class PauseClock:
    """A daemon thread noting the longest time this process was stopped since :meth:`take` was last called."""

    def __init__(self):
        self._longest, self._done = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, name='torchbearer_dist-pause-clock', daemon=True)
        self._thread.start()

    def _run(self):
        last = time.monotonic()
        while not self._done.wait(TICK):
            now = time.monotonic()
            self._longest = max(self._longest, now - last - TICK)
            last = now

    def take(self):
        """Seconds of the longest stop since the last call, if one was longer than :data:`STOPPED`; else 0."""
        longest, self._longest = self._longest, 0.0
        return longest if longest > STOPPED else 0.0

    def stop(self):
        """End the thread; idempotent."""
        self._done.set()
