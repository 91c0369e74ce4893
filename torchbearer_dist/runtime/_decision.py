"""Why a rank stops, decided once: which rank, which cause, and when; no clock, thread or socket.

One fold, :func:`fold`, takes every fact that can end a rank as an :class:`Event` and answers the actions to
take: the heartbeat's verdict (``FOUND``), an error the main thread caught (``CAUGHT``), the store's and the
master's port's answer (``TOLD``), a wait's end (``TICK``), a Ctrl-C the main thread did not take
(``INTERRUPTED``), a clean end (``LEFT``). Its rules are :func:`decide`'s, on :class:`Facts`, and the heartbeat's
:func:`judge`, a fold of its own :class:`Observation` (one per wake-up of the watch thread) into :class:`Memory`,
whose memory every event carries. The live group (:mod:`._live`) is the one applier: it senses, folds and does
what the actions say (publish, wake, stop the peers, wait for the readers, raise the one line). The causes'
words are :mod:`._diagnosis`'s, the waits :mod:`._timing`'s. The launcher's watch of its ranks is folded too (a
:class:`Poll`, applied by :func:`~._supervisor.supervise`): which rank :func:`~torchbearer_dist.launch` names, and
whether it starts its ranks again.

The heartbeat's rules, each learned from a healthy job once ended by the rule before it:

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

On one monotonic clock, which a simulated clock stands in for: ``tests/runtime/test_verdict.py`` runs the
heartbeat, this fold and its applier over thousands of schedules.
"""
import os
import signal
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis as causes
from torchbearer_dist.runtime._timing import Timing
from torchbearer_dist.runtime.errors import EXIT_PREEMPTED, GlooConnectError, PeerFailedError, Preempted

#: Where the main thread is when it stops: group creation (the handshake, gloo's connect, the barrier)
#: failed; the program's block raised; the block ended well.
JOIN, RUN, LEAVE = 'join', 'run', 'leave'
#: What the main thread caught (:func:`classify`): a bad argument; a peer's failure the rendezvous
#: read; the rendezvous' own words (a duplicate rank, a rank that did not join); gloo's connect, which
#: failed; a pre-emption; a collective's or the store's error; anything else the rank raised.
ARGUMENT, REPORTED, SETUP, UNCONNECTED, PREEMPTED = 'argument', 'reported', 'setup', 'unconnected', 'preempted'
COLLECTIVE, OWN = 'collective', 'own'


def classify(error, phase):
    """What the main thread caught, as one of the kinds above."""
    if isinstance(error, Preempted):
        return PREEMPTED
    if isinstance(error, ValueError):
        return ARGUMENT
    if isinstance(error, PeerFailedError):
        return REPORTED
    if isinstance(error, GlooConnectError):
        return UNCONNECTED
    if is_collective_error(error):
        return COLLECTIVE
    return SETUP if phase == JOIN and isinstance(error, RuntimeError) else OWN


_TORCH_DISTRIBUTED = os.path.dirname(os.path.abspath(dist.__file__)) + os.sep


def _raised_in_torch_distributed(error):
    """Whether the innermost frame of ``error``'s traceback is torch.distributed's own code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_TORCH_DISTRIBUTED)


def is_collective_error(error):
    """Whether ``error`` was raised by a collective or the store, rather than by the rank's own code, by its type
    and where it was raised: torch raises a ``DistError`` from the store and nccl (and from a ``Work`` waited
    outside torch.distributed), gloo a plain RuntimeError out of a torch.distributed call."""
    if isinstance(error, getattr(dist, 'DistError', ())):
        return True
    return type(error) is RuntimeError and _raised_in_torch_distributed(error)  # not a PeerFailedError, say


def timed_out(error, silence, limit):
    """Whether a peer fell silent rather than left (which closes its connection within a beat of its last one):
    the error's type says so, or a watched beat was unchanged for half the ``limit`` (``silence``, or None)."""
    if isinstance(error, getattr(dist, 'DistTimeoutError', ())):
        return True
    return silence is not None and silence > limit * Timing.TIMED_OUT


@dataclass(frozen=True)
class Facts:
    """What the main thread knows as it stops, folded from the events (see :func:`fold`); the fields after
    ``gathered`` once the store was asked."""
    env: object
    phase: str = None  # JOIN, RUN or LEAVE
    error: str = None  # what the main thread caught (classify); None at LEAVE
    own: object = None  # the caught error as this rank's own Cause
    reported: int = None  # the rank a REPORTED error names
    heartbeat: object = None  # the Cause the heartbeat found, or read from another rank
    frozen: object = None  # this rank's own pause longer than the limit, just ended
    watching: bool = False  # the heartbeat runs, so it may still name the rank
    silences: dict = field(default_factory=dict)  # {rank: seconds} each watched beat has been seen unchanged
    timed_out: bool = False  # the collective timed out, or a watched peer was silent half the limit
    gathered: bool = False  # the store was asked, as a Decision's ``read`` said
    master: str = 'ok'  # 'ok', 'refused' or 'silent': the master's port, probed
    published: object = None  # the Cause a rank published in the store
    dead: tuple = ()  # local peer ranks seen gone while polling
    store_failed: bool = False  # the store stopped answering while polled
    failed_at: float = 0.0  # when the error was caught (one monotonic clock)
    now: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What happens; one with ``read`` or ``until`` set is not yet decided and asks for another call."""
    cause: object = None  # the root Cause to report, or None (nothing to report)
    own: bool = False  # raise the caught error itself, not a PeerFailedError naming ``cause``
    publish: bool = False  # put ``cause`` in the store, where the others read it
    readers: bool = False  # on rank 0, wait (Timing.READERS at most) until the others have read it
    skip: int = None  # the rank that will not read it (it published it, died or fell silent)
    stop_peers: bool = False  # destroy the group now, so that the peers' collectives fail
    read: float = None  # poll the store this long for a cause (a local peer seen gone ends it, unless timed out)
    until: float = None  # ask again until then, as the heartbeat may still name the rank


def decide(facts, timing):
    """Which rank, which cause, and when: the rules of the main thread's stop, the :class:`Decision` for the
    :class:`Facts`, with the job's :class:`~._timing.Timing` (the heartbeat's and a Ctrl-C's: :func:`fold`)."""
    f, rank = facts, facts.env.rank
    if f.env.world_size == 1 or f.error == PREEMPTED:  # a pre-emption is an agreed end at one step, not a fault
        return Decision(own=True)
    if f.phase == LEAVE:  # this rank's block ended well, but a peer fell silent before leaving
        return Decision(f.heartbeat, own=f.heartbeat is None)
    # gloo's connect failed: where the heartbeat found a peer at fault, that peer; else this rank's interface
    if f.phase == JOIN and f.error != COLLECTIVE and not (f.error == UNCONNECTED and f.heartbeat):
        if f.error == ARGUMENT:  # each rank says its own: nothing to publish
            return Decision(own=True)
        if f.error == REPORTED:  # a peer's cause, read in the rendezvous: rank 0 keeps the store up for the others
            return Decision(own=True, readers=rank == 0, skip=f.reported)
        # the rendezvous' own words are each rank's own (a duplicate rank must not end the job it tried to
        # join), except on rank 0, whose store ends with it: the others then read why
        publish = f.error not in (SETUP, UNCONNECTED) or rank == 0
        return Decision(f.own, own=True, publish=publish, readers=publish and rank == 0)
    cause, own = f.heartbeat or (f.frozen if f.phase == RUN and f.error == COLLECTIVE else None), False
    if cause is None:
        if f.error == COLLECTIVE and not f.gathered:
            return Decision(read=timing.READ_TIMED_OUT if f.timed_out else timing.CAUSE_WAIT)
        cause, own = _explain(f, timing)
        wait = _guess_wait(f, cause, timing)
        if f.now < f.failed_at + wait:  # a rank waiting for rank 0's word in the block wakes rank 0 first
            early = f.phase == RUN and cause.rank == -1 and rank != 0
            return Decision(until=f.failed_at + wait, stop_peers=early)
    if f.phase == JOIN:  # only rank 0 publishes, through its heartbeat's connection, and keeps the store up
        published = not own and rank == 0 and f.watching
        return Decision(cause, own=own, publish=published, readers=published, skip=cause.rank)
    # a cause naming rank 0 is not published by the others: the store lives in rank 0's process; one naming
    # no rank neither: rank 0, which reads every rank's beat, may name the rank (see _explain)
    published = rank == 0 or cause.rank > 0 or cause.kind == causes.LOCAL
    return Decision(cause, own=own, publish=published, readers=rank == 0, skip=cause.rank, stop_peers=True)


def _unless_own_pause(published, frozen, rank):
    """The cause to report for a ``published`` one: the peers' guess that this ``rank`` was lost (a silence or a
    timeout naming it) is, where this rank has just been paused past the limit (``frozen``), that pause, which
    the peers could not tell from a lost host; anything else published stands (a peer's own error, say)."""
    if frozen is not None and published is not None and published.rank == rank and causes.is_guess(published):
        return frozen
    return published


def _guess_wait(f, cause, timing):
    """Seconds after the failure that a guessed ``cause`` waits for the heartbeat (0: none): at the join, for its
    verdict; one naming no rank, on rank 0 until the rank whose beat stopped shows (``Timing.named``), on the
    others until their heartbeat reads rank 0's cause (``Timing.told``)."""
    if not (causes.is_guess(cause) and f.watching):
        return 0.0
    if cause.rank == -1 and f.env.rank != 0:
        return timing.told
    if cause.rank == -1 and f.silences:
        return timing.named
    return timing.guess if f.phase == JOIN else 0.0


def _explain(f, timing):
    """``(cause, own)`` for an error no heartbeat explained: what the store, the probe and the error say."""
    env = f.env
    if f.error != COLLECTIVE:
        return f.own, True
    if f.master == 'refused':
        return causes.master_gone(env), False
    if f.published is not None:  # after a timeout the peer was silent that long: its later words are no cause
        mine = f.published.rank == env.rank and f.published.kind == causes.LOCAL
        return f.published, mine
    if f.store_failed and env.rank != 0 and not f.timed_out:  # the store lives in rank 0
        return causes.master_gone(env), False
    if f.dead and not f.timed_out and not f.store_failed:
        return causes.died(list(f.dead)), False
    others = [r for r in range(env.world_size) if r != env.rank]
    stopped = [r for r, seconds in sorted(f.silences.items()) if seconds > timing.guess]  # no live rank's beat
    who = others[0] if len(others) == 1 else stopped[0] if len(stopped) == 1 else 'a peer rank'
    if f.timed_out:
        return causes.silent(env, who, env.timeout.total_seconds()), False
    return causes.closed(who), False


FOUND, CAUGHT, TOLD, TICK, INTERRUPTED, ENDED = 'found', 'caught', 'told', 'tick', 'interrupted', 'ended'
PUBLISH, WAKE, STOP_PEERS, READ, READERS, WAIT, RAISE = 'publish', 'wake', 'stop', 'read', 'readers', 'wait', 'raise'


@dataclass(frozen=True)
class Event:
    """One fact that can end this rank, as it comes to :func:`fold`, with the heartbeat's memory at that moment."""
    kind: str  # FOUND, CAUGHT, TOLD, TICK, INTERRUPTED or ENDED
    now: float = 0.0
    memory: object = None  # the heartbeat's Memory (None: no heartbeat runs)
    cause: object = None  # FOUND: the Cause found (None: another rank's is in the store); ENDED: a peer's silence
    store_answers: bool = True  # FOUND: the heartbeat's last store round succeeded
    error: BaseException = None  # CAUGHT: what the main thread caught
    phase: str = None  # CAUGHT: JOIN or RUN
    master: str = 'ok'  # TOLD: 'ok', 'refused' or 'silent': the master's port, probed
    published: object = None  # FOUND, TOLD: the Cause published in the store
    store_failed: bool = False  # TOLD: the store did not answer
    read: bool = False  # TOLD, to READERS: every other live rank has read the cause


@dataclass(frozen=True)
class State(Facts):
    """What this rank knows of its stop, folded from every :class:`Event`: the :class:`Facts` (the main thread's
    once it caught an error), and how far its stop has come; replaced, never changed."""
    timing: object = None  # the job's Timing
    until: float = None  # the main thread reads the store, or waits for its readers, until then
    decided: Decision = None  # the main thread's decision, taken once: later facts change nothing


def fold(state, event):
    """Every fact that can end a rank comes here, from any of its threads: ``(state, actions)``, the
    :class:`State` after ``event`` and the actions to take, in order. :func:`decide` holds the rules, :func:`judge`
    the heartbeat's; the live group takes the actions and folds their answers.

    The kinds of :class:`Event`: ``FOUND``, the heartbeat judged a failure; ``CAUGHT``, the main thread caught an
    error (at ``JOIN`` or in the ``RUN``); ``TOLD``, the store and the master's port answered a read; ``TICK``, a
    wait ended; ``INTERRUPTED``, a Ctrl-C the main thread did not take in time; ``ENDED``, the program's block
    ended well.

    The actions, each a tuple led by its kind: ``(PUBLISH, cause, heartbeat)`` put the cause in the store (over
    the heartbeat's connection, or the main thread's); ``(WAKE, store)`` fail this rank's collectives now (with
    ``store``, its store calls while the ranks meet); ``(STOP_PEERS,)`` destroy the group so that the peers'
    collectives fail; ``(READ, probe)`` read the cause published, probing the master's port first (answered by
    a ``TOLD``); ``(READERS, keys, heartbeat)`` whether every other rank has read it (a ``TOLD``);
    ``(WAIT,)`` sleep ``Timing.POLL`` (a ``TICK`` unless a read follows); ``(RAISE, cause)`` raise a
    PeerFailedError naming ``cause``, or, None, the error caught. Rank 0, whose process holds the store, waits for
    its readers: every other rank but the one the cause names (which published it, died or fell silent) and the
    local peers seen gone.

    The launcher's watch of one start of its ranks folds too: a :class:`Watch` and its one event, a :class:`Poll`
    (their exit statuses, reports, the ranks stopped by a signal, a pre-emption signal to the launcher, the clock
    that the grace and the deadline count on, and, answering a ``SENSE``, the ranks that stalled). Its actions:
    ``(FORWARD, ranks)`` pass the pre-emption signal on to the running ranks (SIGTERM), once; ``(SENSE, ranks)``
    which of the ranks left running alone have stalled (the same poll, sensed); ``(WAIT,)`` wait for a rank, or
    ``Timing.CHILDREN_POLL``; the start's end: ``(RETURN,)`` every rank returned, ``(NAME, rank, restarts)`` stop
    the ranks and raise ``rank``'s error (a rank's own error first, then a rank that died without a word, then a
    peer failure, then any rank that did not finish), ``(FAIL, type, line, restarts)`` raise ``type(line)`` (a
    stalled rank, the deadline, or Preempted: every rank that did not finish was pre-empted). ``restarts``: whether
    ``launch(max_restarts=R)`` starts every rank again, as torchrun does after any failure, but not after the
    user's stop (a pre-emption signal to the launcher, a rank ended by Ctrl-C: status 130, or SIGINT) or the
    deadline.
    """
    if isinstance(event, Poll):
        return _watch(state, event)
    s, e, env = state, event, state.env
    quiet = silences(e.memory, e.now) if e.memory is not None else {}  # how long each watched beat has not changed
    if s.decided is not None:  # the main thread decided: only its readers' answer counts now
        if e.kind != TOLD:
            return s, ()
        if e.read or e.now >= s.until:
            return s, ((RAISE, None if s.decided.own else s.decided.cause),)
        actions = ((WAIT,),)
    elif e.kind == INTERRUPTED:  # this rank's own cause: its peers read it, and its own collective fails now
        return s, ((PUBLISH, causes.interrupted(env.rank), False), (WAKE, False)) * (env.world_size > 1)
    elif e.kind == FOUND:  # a cause found is published where the store answers; another rank's was read
        cause = e.cause or _unless_own_pause(e.published, _frozen(s, e), env.rank)  # a guess that this rank was
        publish = e.cause is not None and e.store_answers  # lost, read right after its own pause, is that pause
        return replace(s, heartbeat=cause), ((PUBLISH, cause, True),) * publish + ((WAKE, True),)
    elif e.kind == ENDED:
        d = decide(replace(s, phase=LEAVE, heartbeat=e.cause), s.timing)
        return replace(s, decided=d), ((RAISE, None if d.own else d.cause),)
    else:  # CAUGHT, TICK or the store's answer: the heartbeat runs meanwhile, its verdict and silences are facts too
        if e.kind == CAUGHT:
            kind, silence = classify(e.error, e.phase), max(quiet.values(), default=None)
            s = replace(s, phase=e.phase, error=kind, own=causes.own_cause(env.rank, e.error) if kind != COLLECTIVE
                        else None, reported=getattr(e.error, 'rank', None), watching=e.memory is not None,
                        frozen=_frozen(s, e) if e.phase == RUN and kind == COLLECTIVE else None,
                        timed_out=timed_out(e.error, silence, s.timing.limit), failed_at=e.now)
        elif e.kind == TOLD:  # the store's answer: a cause, a local peer gone, the master gone, or the wait's end
            dead = tuple(sorted(e.memory.dead)) if not s.timed_out and e.memory is not None else ()
            if not (e.published or dead or e.master != 'ok' or e.store_failed or e.now >= s.until):
                return s, ((WAIT,), (READ, False))
            s = replace(s, gathered=True, master=e.master, published=e.published, store_failed=e.store_failed,
                        dead=dead)
        s = replace(s, now=e.now, silences=quiet)
        d = decide(s, s.timing)
        if d.read is not None:
            return replace(s, until=e.now + d.read), ((READ, env.rank != 0),)
        if d.until is not None:  # the peers stopped once (a TICK only follows this wait): rank 0 decides too
            return s, ((STOP_PEERS,),) * (d.stop_peers and e.kind != TICK) + ((WAIT,),)
        s = replace(s, decided=d, until=e.now + s.timing.READERS)
        actions = ((PUBLISH, d.cause, _via_heartbeat(s)),) * d.publish + ((STOP_PEERS,),) * d.stop_peers
        if not d.readers:  # else rank 0's process holds the store: the others read the cause first
            return s, actions + ((RAISE, None if d.own else d.cause),)
    gone = set(e.memory.dead if e.memory is not None else ()) | {s.decided.skip}  # the cause's rank, local peers gone
    unread = tuple('error_seen/{}'.format(r) for r in range(1, env.world_size) if r not in gone)
    return s, actions + ((READERS, unread, _via_heartbeat(s)),)


def _via_heartbeat(facts):
    """Whether the main thread's stop talks to the store over the heartbeat's connection: at the join, its own
    store connections may have been shut to wake gloo."""
    return facts.phase != RUN and facts.error in (COLLECTIVE, UNCONNECTED) and facts.watching


def _frozen(state, event):
    """The Cause naming this rank when it has just been paused for longer than the limit (see :func:`paused`,
    which reads the limit of the job's :class:`~._timing.Timing` as of the heartbeat's :class:`Limits`)."""
    seconds = paused(event.memory, event.now, state.timing) if event.memory is not None else None
    return None if seconds is None else causes.frozen(state.env.rank, seconds, state.timing.limit)


# ---------------------------------------------------------------- the heartbeat's judgement
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

def cause_of(verdict, env):
    """The :class:`Cause` for a heartbeat's :class:`~torchbearer_dist.runtime.Verdict` in ``env``;
    None for a cause another rank published (read it from the store)."""
    return {PUBLISHED: lambda: None, DIED: lambda: causes.died([verdict.rank]),
            FROZEN: lambda: causes.frozen(verdict.rank, verdict.seconds, env.meet_timeout.total_seconds()),
            MASTER_SILENT: lambda: causes.master_silent(env, verdict.seconds)}.get(
                verdict.kind, lambda: causes.no_heartbeat(verdict.rank, verdict.seconds))()


# ---------------------------------------------------------------- the launcher's watch of its ranks
FORWARD, SENSE, RETURN, NAME, FAIL = 'forward', 'sense', 'return', 'name', 'fail'  # the launcher's (see fold)


@dataclass(frozen=True)
class Watch:
    """What :func:`~torchbearer_dist.launch` knows of one start of its ranks, folded from every :class:`Poll`;
    replaced, never changed."""
    grace: float  # seconds to wait after the first failure for the other ranks' reports
    bound: float  # seconds a rank left running alone may use no CPU (Timing.last_rank)
    deadline: float = None  # seconds after which the ranks still running are stopped (None: never)
    failed_at: float = float('inf')  # when a rank first exited with a status but 0 or reported an error (inf: none)
    preempted: bool = False  # a pre-emption signal reached the launcher, and was passed on to the ranks


@dataclass(frozen=True)
class Poll:
    """What the launcher sees of its ranks at one look, rank by rank, as it comes to :func:`fold`."""
    now: float  # seconds since the deadline's clock started (the first start's)
    exitcodes: tuple  # each rank's exit status (None: it runs)
    states: tuple  # what each rank reported: 'ok', 'own' (its own error), 'peer' (a PeerFailedError) or None
    stopped: frozenset = frozenset()  # the running ranks stopped by a signal
    preempted: bool = False  # a pre-emption signal reached the launcher
    stalled: frozenset = None  # of the ranks a SENSE named, those idle for the bound (None: not sensed)


def _watch(s, e):
    """:func:`fold` for the launcher's :class:`Poll`."""
    running = [r for r, code in enumerate(e.exitcodes) if code is None]
    forward = ((FORWARD, running),) * (e.preempted and not s.preempted)
    failed = any(code not in (None, 0) for code in e.exitcodes) or any(state in ('own', 'peer') for state in e.states)
    s = replace(s, preempted=s.preempted or e.preempted, failed_at=min(s.failed_at, e.now) if failed else s.failed_at)
    if not running or failed and (set(running) <= e.stopped or e.now - s.failed_at > s.grace):
        unfinished = [r for r, state in enumerate(e.states) if state != 'ok']  # a stopped rank will not report
        died = [r for r in unfinished if e.exitcodes[r] not in (None, 0)]
        if not unfinished or died and all(e.exitcodes[r] == EXIT_PREEMPTED for r in unfinished):
            return s, forward + ((FAIL, Preempted, 'every rank was pre-empted after its checkpoint; run again to '
                                  'resume', False) if unfinished else (RETURN,),)
        rank = ([r for r in unfinished if e.states[r] == 'own'] + [r for r in died if e.states[r] is None] +
                [r for r in unfinished if e.states[r] == 'peer'] + unfinished)[0]
        return s, forward + ((NAME, rank, not s.preempted and e.exitcodes[rank] not in (130, -signal.SIGINT)),)
    if not failed and len(running) < len(e.exitcodes):  # ranks left running alone
        if e.stalled is None:
            return s, forward + ((SENSE, running),)
        if e.stalled:  # a stopped one first: the others may be waiting for it
            line = ('rank {} did not end within {:g} s of the other ranks, and used no CPU meanwhile: it is frozen '
                    '(stopped by a signal, or stuck in native code); stopped it')
            rank = min(e.stalled, key=lambda r: (r not in e.stopped, r))
            return s, forward + ((FAIL, RuntimeError, line.format(rank, s.bound), not s.preempted),)
    if s.deadline is not None and e.now > s.deadline:
        line = 'ranks {} still running after the {:g} s deadline; stopped them'.format(running, s.deadline)
        return s, forward + ((FAIL, RuntimeError, line, False),)
    return s, forward + ((WAIT,),)
