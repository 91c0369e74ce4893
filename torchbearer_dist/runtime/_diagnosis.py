"""The causes of a rank's stop, in words, and how they travel: published once in the store, read by the others.

gloo says "Connection closed by peer" or "Timed out waiting ...", never naming the rank or its error; a
:class:`Cause` does. Which cause wins is :func:`~torchbearer_dist.runtime._decision.fold`'s, from facts,
never the message's words (a rank's own ``DataLoader timed out`` is its own).
"""
import json
from dataclasses import asdict, dataclass
from datetime import timedelta

from torchbearer_dist.runtime._timing import Timing

LOCAL, PEER, NETWORK = 'local', 'peer', 'network'
_SHORT = timedelta(seconds=Timing.STORE_CALL)


@dataclass(frozen=True)
class Cause:
    """The root cause of a failed job, as one rank saw it."""
    rank: int  # the rank that failed (or fell silent)
    kind: str  # LOCAL (its own error), PEER (it died or left) or NETWORK (it fell silent)
    exc_type: str  # the exception type's name, '' when the rank could not say
    message: str  # one line
    # only guessed from how a collective failed (a closed connection, a timeout), rather than published by a
    # rank, judged by the heartbeat, seen in the process table or told by a refused connection
    guess: bool = False

    def line(self):
        """str: the sentence every rank reports, e.g. ``'rank 1 failed: ValueError: bad batch'``."""
        if self.kind == LOCAL:
            return 'rank {} failed: {}'.format(self.rank, '{}: {}'.format(self.exc_type, self.message)
                                               if self.message else self.exc_type)
        return self.message

    def to_json(self):
        """str: the cause as stored."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text):
        """The cause stored by :meth:`to_json`."""
        return cls(**json.loads(text))


def own_cause(rank, error):
    """The :class:`Cause` for ``error`` raised by this rank's own code."""
    text = str(error).strip().splitlines()
    return Cause(rank, LOCAL, type(error).__name__, text[0] if text else '')


def describe(error):
    """One line for an exception, e.g. ``'ValueError: bad batch'``: its type and its message's first line."""
    return own_cause(0, error).line()[len('rank 0 failed: '):]


def publish(store, cause):
    """Record ``cause`` in the job's ``store``, unless another rank's cause is already there."""
    try:
        store.set_timeout(_SHORT)
        store.compare_set('error', '', cause.to_json())
    except Exception:  # the store is gone with rank 0: nothing to tell
        pass


def read_cause(store, reader):
    """The :class:`Cause` published in the job's ``store``, or None. ``reader``, this rank, is marked as having
    read it (``error_seen/<rank>``): rank 0, whose process holds the store, waits for its readers (see
    :func:`~torchbearer_dist.runtime._decision.fold`). Raises what the store raises when it stops answering."""
    store.set_timeout(_SHORT)
    if not store.check(['error']):
        return None
    cause = Cause.from_json(store.get('error').decode())
    store.set('error_seen/{}'.format(reader), '1')  # read: rank 0 may end its store now
    return cause


def interrupted(rank):
    """The :class:`Cause` for a Ctrl-C that ``rank``'s main thread, blocked in a collective, did not take in time."""
    return Cause(rank, LOCAL, 'KeyboardInterrupt', 'interrupted (SIGINT)')


def died(ranks):
    """The :class:`Cause` for peers of this machine whose processes are gone without a word."""
    return Cause(ranks[0], PEER, '', 'rank {} died without reporting an error: it was killed (by the OOM '
                                     'killer, or a signal) or crashed in native code; see its log and '
                                     'dmesg'.format(', '.join(map(str, ranks))))


def master_gone(env):
    """The :class:`Cause` for a store that stopped answering: rank 0's process or host is gone."""
    return Cause(0, PEER, '', 'rank 0 (the master at {}) is gone: its process died or its host became '
                              'unreachable; see rank 0\'s log for its error'.format(env.address))


def _named(who):
    """``(rank, words)`` for ``who``, a rank or words such as ``'a peer rank'`` (rank -1)."""
    return (who, 'rank {}'.format(who)) if isinstance(who, int) else (-1, who)


def silent(env, who, seconds):
    """The :class:`Cause` for a collective in which ``who`` (a rank, or words) sent nothing for ``seconds``."""
    return Cause(_named(who)[0], NETWORK, '', 'no answer from {} for {:g} s: its host is down, the network is '
                 'partitioned, or it is stuck outside the training loop; check that host, or raise timeout= if a '
                 'step can take that long'.format(_named(who)[1], seconds))


def no_heartbeat(rank, seconds):
    """The :class:`Cause` for a rank whose heartbeat stopped for ``seconds``: its process or host is gone."""
    return Cause(rank, NETWORK, '', 'no heartbeat from rank {} for {:g} s: its host is down or the network is '
                 'partitioned (a rank that is merely busy keeps beating); check that host and the network, or '
                 'raise rendezvous_timeout='.format(rank, seconds))


def master_silent(env, seconds):
    """The :class:`Cause` for a store (rank 0's process) that stopped answering for ``seconds``."""
    return Cause(0, NETWORK, '', 'no answer from rank 0 (the master at {}) for {:g} s: its host is down or the '
                 'network is partitioned; check that host and the network, or raise rendezvous_timeout='.format(
                     env.address, seconds))


def frozen(rank, seconds, limit):
    """The :class:`Cause` for this rank, which did not run for ``seconds``, longer than the rendezvous
    timeout ``limit``: its peers took it for lost meanwhile."""
    return Cause(rank, NETWORK, '', 'rank {} did not run for {:.0f} s, longer than the rendezvous timeout ({:g} s), '
                 'and the other ranks took it for lost: it was stopped (Ctrl-Z, kill -STOP), its machine was paused, '
                 'or its main thread held the GIL in one native call; let it run, or raise rendezvous_timeout='.format(
                     rank, seconds, limit))




def is_guess(cause):
    """Whether ``cause`` names a rank less surely than a rank's own report, a death seen in the process
    table or a refused connection could: a silence (the network's kind), or :attr:`Cause.guess`."""
    return cause.kind == NETWORK or cause.guess


def closed(who):
    """The :class:`Cause` guessed for a collective whose peer ``who`` (a rank, or words) closed its connection."""
    return Cause(_named(who)[0], PEER, '', '{} closed its connection without reporting an error: it exited or was '
                 'killed; see its log'.format(_named(who)[1]), guess=True)
