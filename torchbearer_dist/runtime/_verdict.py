"""The heartbeat's judgement: who failed, and how, from what was observed; no clock, thread or socket.

:class:`~torchbearer_dist.runtime._watchdog.Watchdog` samples and applies; :func:`judge` decides, as a fold of
:class:`Observation` (one per wake-up of the watch thread) into :class:`Memory`, on one monotonic clock, which a
simulated clock can stand in for (``tests/runtime/test_verdict.py`` tries thousands of schedules).

The rules, each learned from a healthy job once ended by the rule before it:

- A peer's silence counts from the sample that saw its beat change to the *beginning* of the round that
  read it unchanged, so a peer named silent for the limit was, however slow the store calls. (Counted
  from the sample before, a busy rank 0 beating a little slower than sampled read as silent: 1 job in 30.)
- A wake-up gap of half the limit means this process did not run (load delays a thread far less): what
  was read before is not judged, and a gap longer than the limit is this rank's own pause, which wins
  over any cause it finds for the next limit and over a peer that never beat again after it (its peers
  took it for lost, and left). A gap of a beat or two is not a pause: resetting then let a loaded rank 0
  never name a stopped peer.
- A local peer gone while still beating, and not marked left in a round begun after it was seen gone,
  died; one whose beats stopped more than half the limit before it went gave up, and is named silent.
- A rank other than 0 whose store rounds all failed or blocked for the limit names rank 0 (the store
  lives in its process); two failed rounds in a row right after its own long pause are that pause.
- A cause published in the store by any rank wins over everything this rank would judge.
"""
from dataclasses import dataclass, field, replace

from torchbearer_dist.runtime._timing import Timing

#: Added to a rank's heartbeat counter when it leaves the job cleanly: from then on it is not watched.
LEFT = 1 << 40

#: Verdict kinds: another rank's cause is in the store; a peer's beat stopped; a local peer's process
#: went; the store (rank 0) stopped answering; this rank did not run for longer than the limit.
PUBLISHED, SILENT, DIED, MASTER_SILENT, FROZEN = 'published', 'silent', 'died', 'master silent', 'frozen'


@dataclass(frozen=True)
class Limits:
    """What judging needs to know of the job."""
    rank: int  # this rank
    watched: tuple  # the ranks whose beats it reads: every other rank on rank 0, else rank 0
    limit: float  # the rendezvous timeout, seconds: the longest silence that is not a failure


@dataclass(frozen=True)
class Sample:
    """One store round of the heartbeat thread that succeeded."""
    began: float  # before its first call
    ended: float  # when its last call returned
    error: bool = False  # a cause was published in the store
    values: tuple = None  # the watched ranks' heartbeat counters, in Limits.watched order; None before a round


@dataclass(frozen=True)
class Observation:
    """What the watch thread sees when it wakes."""
    now: float
    sample: Sample  # the last store round that succeeded
    failed: float = float('-inf')  # when a store round last failed (-inf: never)
    failures: int = 0  # store rounds failed in a row since the last that succeeded
    dead: frozenset = frozenset()  # local peer ranks whose process is gone


@dataclass(frozen=True)
class Memory:
    """What judging carries from one wake-up to the next; replaced, never changed."""
    awake: float  # when the watch thread last woke
    resumed: float  # when it woke after its last gap of half the limit (or started)
    frozen: tuple = None  # (seconds, when) of its last gap longer than the limit
    judged: float = None  # Sample.ended of the last sample judged
    last: dict = field(default_factory=dict)  # rank: the counter value last seen
    changed: dict = field(default_factory=dict)  # rank: Sample.ended of the sample that saw that value first
    unchanged: frozenset = frozenset()  # ranks whose counter has not changed since first read (since `resumed`)
    dead: dict = field(default_factory=dict)  # rank: when its process was first seen gone


@dataclass(frozen=True)
class Verdict:
    """A failure found."""
    kind: str  # PUBLISHED, SILENT, DIED, MASTER_SILENT or FROZEN
    rank: int  # the rank at fault; -1 for PUBLISHED (the store says)
    seconds: float  # how long it was silent, or this rank did not run (FROZEN)
    store_answers: bool  # so that the cause can be published there


def start(now):
    """The :class:`Memory` of a watch that starts at ``now``."""
    return Memory(awake=now, resumed=now)


def paused(memory, now, limits):
    """Seconds this rank did not run when that was longer than the limit and no more than a limit ago (its peers
    then took it for lost), else None; also right after the pause, before the watch thread woke again."""
    if now - memory.awake > limits.limit:
        return now - memory.awake
    if memory.frozen is not None and now - memory.frozen[1] <= limits.limit:
        return memory.frozen[0]
    return None


def silences(memory, now):
    """``{rank: seconds}`` since each watched peer's beat last changed, of the peers whose beat was read since
    the watch started or this rank's last gap (a peer marked left is not silent)."""
    return {rank: now - memory.changed[rank] for rank, value in memory.last.items() if int(value) < LEFT}


def judge(memory, seen, limits):
    """Judge one wake-up of the watch thread: ``(memory, verdict)``, the :class:`Memory` for the next wake-up
    (``memory`` is the last one's, :func:`start`'s for the first) and the :class:`Verdict`, None while nothing
    has failed."""
    now, limit = seen.now, limits.limit
    last, changed, resumed, frozen = memory.last, memory.changed, memory.resumed, memory.frozen
    if now - memory.awake > limit * Timing.ASLEEP:  # this process did not run: judge nothing read before
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
            last[rank] = value  # left: never silent (see silences)
            continue
        if (rank in dead and sample.began > dead[rank] and
                dead[rank] - changed.get(rank, now) <= limit * Timing.DIED_BEATING):
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
