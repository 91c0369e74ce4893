"""Every wait and threshold of the fault machinery, in one place: derived from the user's two timeouts, with
its reason; and the one loop that waits for a condition (:func:`poll`)."""
import time


class Timing:
    """The waits of a job whose rendezvous timeout is ``limit`` and collective timeout ``timeout`` (seconds).
    The fixed ones, class attributes, bound a local or one-round-trip action, not a peer; the heartbeat's
    rules read their parts of the limit and of a beat here too."""
    STORE_CALL = 2.0  # a publish or read of a cause
    PROBE = 1.0  # whether the master's port accepts
    LEAVE_CALL = 1.0  # marking this rank left, against a master that may be frozen
    # a failed collective polls this long for the peer's cause (the peer wakes, unwinds and publishes within it);
    # after a timeout, when the peer was silent for the timeout, this long
    CAUSE_WAIT, READ_TIMED_OUT = 3.0, 1.0
    READERS = 3.0  # rank 0, whose process holds the store, waits at most this long for the others to read a cause
    CONNECT_GRACE = 2.0  # a main thread still inside gloo's connect this long after it was woken is ended
    STOPPED_EARLY = 3.0  # launch() names a rank stopped by a signal that much sooner: it is surely frozen
    # after Ctrl-C, the main thread's own handling gets this long, then its collective is failed, and this long
    # again before a main thread stuck in native code is ended
    INTERRUPT_GRACE = 2.0
    # a replica of the fault-tolerant mode ends this long after SIGINT or SIGTERM at the latest (ft/_signals.py)
    REPLICA_STOP_GRACE = 1.5
    # launch() waits this long after the first failure for the other ranks' reports (the root cause may come second)
    KILL_GRACE = 3.0
    POLL = 0.05  # a loop waiting for a condition (a peer's cause, the readers, a decision's wait) checks this often
    CHILDREN_POLL = 0.1  # launch() and a port that refuses are looked at again this often
    WATCH_STOP = 0.5  # the heartbeat's threads get this long to end when stopped (not a store call on a silent host)
    # a heartbeat thread joined at the exit gets its store call's timeout, a beat and this long more to return
    WATCH_JOIN = 1.0
    SAMPLES_PER_BEAT = 4  # the watch samples this often per beat: a silence is measured to a quarter of a beat
    # a failed collective timed out (rather than its peer left, which closes the connection within a beat) where
    # the peer's beat was unchanged for this part of the limit
    TIMED_OUT = 0.5
    # a watch thread that wakes this part of the limit late did not run (load delays a thread far less): what it
    # read before is not judged
    ASLEEP = 0.5
    # a local peer gone whose beat changed within this part of the limit before died; one silent longer gave up
    DIED_BEATING = 0.5
    DRAIN = 2.0  # launch() waits this long for the ranks' last stderr lines (a rank's own child may hold the pipe)
    # a last rank left alone is idle while it uses under this share of a core: frozen or waiting for gone peers
    # uses none, rank-0-only work uses a core, its heartbeat threads far less
    IDLE_SHARE = 0.01
    IDLE_SLACK = 0.05  # CPU seconds over that share still idle: /proc counts CPU time in ticks of 10 ms
    REQUEUE_CALL = 30.0  # SLURM's scontrol requeue, at a preemption

    def __init__(self, limit, timeout=None):
        self.limit = limit
        self.timeout = limit if timeout is None else timeout
        self.beat = min(1.0, limit / 4)  # between heartbeats (a beat late under load is no silence)
        # the heartbeat's store calls: one blocked on a silent master fails in time for the next round
        self.heartbeat_call = min(5.0, limit / 2)
        # at the join, the heartbeat may still name the rank when gloo's words were only a guess: a live peer's
        # beat is never seen unchanged for longer
        self.guess = 2 * self.beat + 1.0
        # a closed connection in a job of three or more names no rank; rank 0 names the one whose beat stopped:
        # seen at most a beat before the failure, it is unchanged for `guess` this long after
        self.named = self.guess + self.beat
        # the other ranks wait this long for rank 0's cause then: it names the rank `named` after its failure,
        # or silent two beats and a quarter after the limit, which they read within a beat and a quarter
        self.told = limit + self.named
        self.gloo_connect = min(self.timeout, limit)  # gloo's connect waits for every peer this long
        # the store client against a port whose program accepts and never answers, which torch does not bound
        self.listener = 1.5 * limit + 5.0
        # launch() stops a last rank idle this long: two one-second beats and a second more for the ranks' own
        # heartbeat to name it first
        self.last_rank = limit + 3.0

    @classmethod
    def of(cls, env):
        """The :class:`Timing` of ``env`` (a :class:`~torchbearer_dist.runtime.env.DistEnv`)."""
        return cls(env.meet_timeout.total_seconds(), env.timeout.total_seconds())


def poll(ready, seconds, step=Timing.POLL):
    """Call ``ready`` every ``step`` seconds until it returns a true value, or for ``seconds`` at most.

    Returns:
        its last value
    """
    deadline = time.monotonic() + seconds
    while True:
        value = ready()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)
