"""The heartbeat's judgement: who failed, and how, from what was observed; no clock, thread or socket.

:class:`~torchbearer_dist.runtime._watchdog.Watchdog` samples (the last store round that succeeded,
when one last failed, which local peers are gone, the time) and applies; :func:`judge` decides. It is
a fold: each wake-up of the watch thread is one :class:`Observation`, and what judging needs to
remember between two wake-ups is a :class:`Memory`. Every time is a float of one monotonic clock, in
seconds; a simulated clock serves as well (``tests/runtime/test_verdict.py`` tries thousands of
schedules).

The rules, each one learned from a healthy job once ended by the rule before it:

- A peer's silence is counted from the sample that saw its last beat change, to the *beginning* of
  the round that read it unchanged: the beat surely came no earlier than the one, and the value was
  read no earlier than the other, so a peer named silent for the limit was silent at least that long,
  however slowly the store calls returned. (Counted from the sample before, a busy rank 0 beating a
  little slower than it was sampled read as silent: 1 healthy job in 30 under load.)
- A wake-up gap of this process of half the limit means it did not run (a loaded machine delays a
  thread far less): what was read before is not judged, silences count from the first round begun
  after it, and a gap longer than the limit is this rank's own pause, which then wins over any cause
  it finds for the next limit, and over the silence of a peer that never beat again after it: its
  peers took it for lost meanwhile, and left. A gap of a beat or two is not
  a pause: resetting then let a loaded rank 0 never name a stopped peer.
- A local peer gone while still beating, and not marked left in a round begun after it was seen
  gone, died (killed, or crashed in native code); one whose beats had stopped more than half the
  limit before it went gave up after being cut off, and is named for its silence.
- A rank other than 0 whose store rounds all failed or blocked for the limit names rank 0 (the store
  lives in its process); two failed rounds in a row right after its own long pause are that pause.
- A cause published in the store by any rank wins over everything this rank would judge.
"""
from dataclasses import dataclass, field, replace

#: Added to a rank's heartbeat counter when it leaves the job cleanly: from then on it is not watched.
LEFT = 1 << 40

#: Verdict kinds: another rank's cause is in the store; a peer's beat stopped; a local peer's process
#: went; the store (rank 0) stopped answering; this rank did not run for longer than the limit.
PUBLISHED, SILENT, DIED, MASTER_SILENT, FROZEN = 'published', 'silent', 'died', 'master silent', 'frozen'


@dataclass(frozen=True)
class Limits:
    """What judging needs to know of the job.

    Attributes:
        rank (int): this rank
        watched (tuple): the ranks whose beats this rank reads (every other rank on rank 0, else rank 0)
        limit (float): the rendezvous timeout, seconds: the longest silence that is not a failure
    """
    rank: int
    watched: tuple
    limit: float


@dataclass(frozen=True)
class Sample:
    """One store round of the heartbeat thread that succeeded.

    Attributes:
        began (float): when the round began (before its first call)
        ended (float): when its last call returned
        error (bool): whether a cause was published in the store
        values (tuple): the watched ranks' heartbeat counters, in :attr:`Limits.watched` order; None
            before the first round
    """
    began: float
    ended: float
    error: bool = False
    values: tuple = None


@dataclass(frozen=True)
class Observation:
    """What the watch thread sees when it wakes.

    Attributes:
        now (float): when it woke
        sample (Sample): the last store round that succeeded
        failed (float): when a store round last failed (-inf: never)
        failures (int): store rounds failed in a row since the last that succeeded
        dead (frozenset): local peer ranks whose process is gone
    """
    now: float
    sample: Sample
    failed: float = float('-inf')
    failures: int = 0
    dead: frozenset = frozenset()


@dataclass(frozen=True)
class Memory:
    """What judging carries from one wake-up to the next; replaced, never changed.

    Attributes:
        awake (float): when the watch thread last woke
        resumed (float): when it woke after its last gap of half the limit (or started)
        frozen (tuple): ``(seconds, when)`` of its last gap longer than the limit, or None
        judged (float): :attr:`Sample.ended` of the last sample judged
        last (dict): rank to the counter value last seen
        changed (dict): rank to :attr:`Sample.ended` of the sample that saw that value first
        unchanged (frozenset): ranks whose counter has not changed since this watch first read it
            (after it started, or after its last gap of half the limit)
        dead (dict): rank to when its process was first seen gone
    """
    awake: float
    resumed: float
    frozen: tuple = None
    judged: float = None
    last: dict = field(default_factory=dict)
    changed: dict = field(default_factory=dict)
    unchanged: frozenset = frozenset()
    dead: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """A failure found.

    Attributes:
        kind (str): :data:`PUBLISHED`, :data:`SILENT`, :data:`DIED`, :data:`MASTER_SILENT` or :data:`FROZEN`
        rank (int): the rank at fault; -1 for :data:`PUBLISHED` (the store says)
        seconds (float): how long it was silent, or this rank did not run (:data:`FROZEN`)
        store_answers (bool): whether the store still answers, so that the cause can be published there
    """
    kind: str
    rank: int
    seconds: float
    store_answers: bool


def start(now):
    """The :class:`Memory` of a watch that starts at ``now``."""
    return Memory(awake=now, resumed=now)


def paused(memory, now, limits):
    """Seconds this rank did not run when that was longer than the limit and no more than a limit ago
    (its peers then took it for lost), else None.

    Also right after the pause, before the watch thread has woken again: its last wake-up is then
    older than the limit.
    """
    if now - memory.awake > limits.limit:
        return now - memory.awake
    if memory.frozen is not None and now - memory.frozen[1] <= limits.limit:
        return memory.frozen[0]
    return None


def silences(memory, now):
    """``{rank: seconds}`` since each watched peer's beat last changed, of the peers whose beat was read since
    the watch started or this rank's last gap (a peer marked left is not silent)."""
    return {rank: now - memory.changed[rank] for rank, value in memory.last.items() if int(value) < LEFT}


def silence(memory, now):
    """Seconds since the longest-silent watched peer's beat last changed, or None (see :func:`silences`)."""
    return max(silences(memory, now).values(), default=None)


def judge(memory, seen, limits):
    """Judge one wake-up of the watch thread.

    Args:
        memory (Memory): what the previous wake-up left (:func:`start` for the first)
        seen (Observation): what this wake-up sees
        limits (Limits): the job

    Returns:
        tuple: ``(memory, verdict)``: the :class:`Memory` for the next wake-up, and the
        :class:`Verdict`, or None while nothing has failed
    """
    now, limit = seen.now, limits.limit
    last, changed, resumed, frozen = memory.last, memory.changed, memory.resumed, memory.frozen
    if now - memory.awake > limit / 2:  # this process did not run: judge nothing read before
        last, changed, resumed = {}, {}, now
        memory = replace(memory, unchanged=frozenset())
        if now - memory.awake > limit:
            frozen = (now - memory.awake, now)
    dead = dict(memory.dead)
    for rank in sorted(seen.dead):
        dead.setdefault(rank, now)
    memory = replace(memory, awake=now, resumed=resumed, frozen=frozen, last=last, changed=changed, dead=dead)
    sample = seen.sample
    if sample.error:
        return memory, Verdict(PUBLISHED, -1, 0.0, True)
    own = paused(memory, now, limits)
    if limits.rank != 0 and (now - max(sample.ended, resumed) > limit or
                             seen.failed > resumed and seen.failures >= 2 and own is not None):
        return memory, _blame(Verdict(MASTER_SILENT, 0, limit, False), own, limits)
    if sample.values is None or sample.ended == memory.judged or sample.began < resumed:
        return memory, None
    last, changed, unchanged = dict(last), dict(changed), set(memory.unchanged)
    memory = replace(memory, judged=sample.ended, last=last, changed=changed)
    for rank, value in zip(limits.watched, sample.values):
        if int(value) >= LEFT:
            last[rank] = value  # left: never silent (see silence)
            continue
        if rank in dead and sample.began > dead[rank] and dead[rank] - changed.get(rank, now) <= limit / 2:
            return memory, _blame(Verdict(DIED, rank, 0.0, rank != 0), own, limits)  # rank 0 held the store
        if last.get(rank) != value:
            (unchanged.add if rank not in last else unchanged.discard)(rank)
            last[rank], changed[rank] = value, sample.ended
        elif sample.began - changed[rank] > limit:
            if own is None and rank in unchanged and frozen is not None and changed[rank] >= frozen[1]:
                own = frozen[0]  # it has not beaten since this rank came back from its long pause: it gave up
            verdict = _blame(Verdict(SILENT, rank, limit, True), own, limits)
            return replace(memory, unchanged=frozenset(unchanged)), verdict
    return replace(memory, unchanged=frozenset(unchanged)), None


def _blame(verdict, own, limits):
    """What goes wrong right after a long pause of this rank is that pause."""
    return verdict if own is None else Verdict(FROZEN, limits.rank, own, verdict.store_answers)
