"""Why a rank stops, decided once: which rank, which cause, and when; no clock, thread or socket.

Every path that ends a rank asks :func:`decide`: the heartbeat's thread when it judged a failure
(``HEARTBEAT``), the main thread when the handshake or gloo's connect failed (``JOIN``), when the program's
block raised (``RUN``) or ended while a peer fell silent (``LEAVE``), and the Ctrl-C watcher when the main
thread did not take a Ctrl-C in time (``INTERRUPT``); :func:`first_failure` asks it for
:func:`~torchbearer_dist.launch`, which asks :func:`restarts_after` whether to start its ranks again. The live
group (:mod:`._live`) gathers the :class:`Facts` and acts on the :class:`Decision`; the causes' words are
:mod:`._diagnosis`'s, the waits :mod:`._timing`'s."""
import os
import signal
from dataclasses import dataclass, field

import torch.distributed as dist

from torchbearer_dist.runtime import _diagnosis as causes
from torchbearer_dist.runtime._timing import Timing
from torchbearer_dist.runtime.errors import PeerFailedError, Preempted

#: Where a rank is when it stops: its heartbeat judged; group creation (the handshake, gloo's
#: connect, the barrier) failed; the program's block raised; the block ended well; a Ctrl-C its main
#: thread, blocked in native code, did not take within the watcher's grace.
HEARTBEAT, JOIN, RUN, LEAVE, INTERRUPT = 'heartbeat', 'join', 'run', 'leave', 'interrupt'
#: What the main thread caught (:func:`classify`): a bad argument; a peer's failure the rendezvous
#: read; the rendezvous' own words (a duplicate rank, a rank that did not join); a pre-emption;
#: a collective's or the store's error; anything else the rank raised.
ARGUMENT, REPORTED, SETUP, PREEMPTED = 'argument', 'reported', 'setup', 'preempted'
COLLECTIVE, OWN = 'collective', 'own'


def classify(error, phase):
    """What the main thread caught, as one of the kinds above."""
    if isinstance(error, Preempted):
        return PREEMPTED
    if isinstance(error, ValueError):
        return ARGUMENT
    if isinstance(error, PeerFailedError):
        return REPORTED
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
    if isinstance(error, PeerFailedError):
        return False
    if isinstance(error, getattr(dist, 'DistError', ())):
        return True
    return type(error) is RuntimeError and _raised_in_torch_distributed(error)


def timed_out(error, silence, limit):
    """Whether a peer fell silent rather than left (which closes its connection within a beat of its last one):
    the error's type says so, or a watched beat was unchanged for half the ``limit`` (``silence``, or None)."""
    if isinstance(error, getattr(dist, 'DistTimeoutError', ())):
        return True
    return silence is not None and silence > limit * Timing.TIMED_OUT


@dataclass(frozen=True)
class Facts:
    """What a rank knows when it asks, gathered by the live group; the fields after ``gathered`` once the store
    was asked."""
    env: object
    phase: str  # HEARTBEAT, JOIN, RUN, LEAVE or INTERRUPT
    error: str = None  # what the main thread caught (classify); None at HEARTBEAT, LEAVE or INTERRUPT
    own: object = None  # the caught error as this rank's own Cause
    reported: int = None  # the rank a REPORTED error names
    heartbeat: object = None  # the Cause the heartbeat found (the live group's ``cause``)
    frozen: object = None  # this rank's own pause longer than the limit, just ended
    store_answers: bool = True  # the heartbeat's last store round succeeded
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
    wake: bool = False  # wake this rank's main thread from its collective (or gloo's connect)
    read: float = None  # poll the store this long for a cause, then ask again
    deaths: bool = True  # with ``read``, a local peer seen gone ends the poll
    until: float = None  # ask again until then, as the heartbeat may still name the rank


def decide(facts, timing):
    """Which rank, which cause, and when: every rule of a rank's stop, in one place: the :class:`Decision` for
    the :class:`Facts`, with the job's :class:`~._timing.Timing`."""
    f, rank = facts, facts.env.rank
    if f.phase == HEARTBEAT:  # a cause found is published where the store answers; else another rank's is read
        if f.heartbeat is None and not f.gathered:
            return Decision(read=0.0, deaths=False)
        return Decision(f.heartbeat or _unless_own_pause(f.published, f.frozen, rank),
                        publish=f.heartbeat is not None and f.store_answers, wake=True)
    if f.phase == INTERRUPT:  # this rank's own cause: its peers read it, and its own collective fails now
        return Decision(causes.interrupted(rank), publish=f.env.world_size > 1, wake=f.env.world_size > 1)
    if f.env.world_size == 1 or f.error == PREEMPTED:  # a pre-emption is an agreed end at one step, not a fault
        return Decision(own=True)
    if f.phase == LEAVE:  # this rank's block ended well, but a peer fell silent before leaving
        return Decision(f.heartbeat, own=f.heartbeat is None)
    if f.phase == JOIN and f.error != COLLECTIVE:
        if f.error == ARGUMENT:  # each rank says its own: nothing to publish
            return Decision(own=True)
        if f.error == REPORTED:  # a peer's cause, read in the rendezvous: rank 0 keeps the store up for the others
            return Decision(own=True, readers=rank == 0, skip=f.reported)
        # the rendezvous' own words are each rank's own (a duplicate rank must not end the job it tried to
        # join), except on rank 0, whose store ends with it: the others then read why
        publish = f.error != SETUP or rank == 0
        return Decision(f.own, own=True, publish=publish, readers=publish and rank == 0)
    cause, own = f.heartbeat or (f.frozen if f.phase == RUN and f.error == COLLECTIVE else None), False
    if cause is None:
        if f.error == COLLECTIVE and not f.gathered:
            return Decision(read=timing.read_wait(f.timed_out), deaths=not f.timed_out)
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


def first_failure(states, exitcodes, preempted_status):
    """The rank :func:`~torchbearer_dist.launch` names: a rank's own error first, then a rank that died without a
    word, then a peer failure, then any rank that did not finish; None when every rank that did not finish was
    pre-empted (and one was). Per rank, ``states`` says what it reported (``'ok'``, ``'own'``, ``'peer'``: a
    PeerFailedError, or None) and ``exitcodes`` its status (None while it runs)."""
    unfinished = [r for r, state in enumerate(states) if state != 'ok']
    died = [r for r in unfinished if exitcodes[r] not in (None, 0)]
    if died and all(exitcodes[r] == preempted_status for r in unfinished):
        return None
    return ([r for r in unfinished if states[r] == 'own'] + [r for r in died if states[r] is None] +
            [r for r in unfinished if states[r] == 'peer'] + unfinished)[0]


def restarts_after(ending, interrupted_status=130):
    """Whether ``launch(max_restarts=R)``, its restarts not yet spent, starts every rank again after a start that
    failed (``ending``: :class:`~torchbearer_dist.runtime._supervisor.Ending`). After any failure of a rank, as
    torchrun does, even an error that will recur; not after the user's stop (a pre-emption signal to the launcher,
    a root cause ended by Ctrl-C: the status ``interrupted_status`` a rank exits with, or SIGINT), the deadline, or
    a failure to start the ranks at all (torchrun's agent does not restart that either)."""
    return ending.watched and not (ending.preempted or ending.deadline or
                                   ending.status in (interrupted_status, -signal.SIGINT))
