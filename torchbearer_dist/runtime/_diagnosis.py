"""Why a rank stopped: a structured cause published through the store, and read back by the peers.

gloo reports a dead peer as "Connection closed by peer" and a silent one as "Timed out waiting ...",
never naming the rank or its error. Here the first rank to fail publishes a :class:`Cause` (its rank,
the exception type and whether it was a ``local`` error, a ``peer`` that died or the ``network``)
under one key of the job's store; every other rank reads it back, so the whole job ends naming one
root cause. The kind is decided by facts (what was caught, where it was raised, what the heartbeat
saw), never by searching the message for words such as "timed out": a rank's own ``DataLoader timed
out`` is a local error of that rank, not a dead host.
"""
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from torchbearer_dist.runtime import _peers, _verdict
from torchbearer_dist.runtime.errors import PeerFailedError

LOCAL, PEER, NETWORK = 'local', 'peer', 'network'
_SHORT = timedelta(seconds=2)


@dataclass(frozen=True)
class Cause:
    """The root cause of a failed job, as one rank saw it.

    Attributes:
        rank (int): the rank that failed (or fell silent)
        kind (str): ``'local'``, ``'peer'`` or ``'network'``
        exc_type (str): the exception type's name, ``''`` when the rank could not say
        message (str): one line
        guess (bool): only guessed from how a collective failed (a closed connection, a timeout), rather
            than published by a rank, judged by the heartbeat, seen in the process table or told by a
            refused connection
    """
    rank: int
    kind: str
    exc_type: str
    message: str
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


def describe(error):
    """One line for an exception: ``Type: first line of its message``.

    Args:
        error (BaseException): the exception

    Returns:
        str: e.g. ``'ValueError: bad batch'``
    """
    text = str(error).strip().splitlines()
    return '{}: {}'.format(type(error).__name__, text[0]) if text else type(error).__name__


def own_cause(rank, error):
    """The :class:`Cause` for ``error`` raised by this rank's own code."""
    text = str(error).strip().splitlines()
    return Cause(rank, LOCAL, type(error).__name__, text[0] if text else '')


_TORCH_DISTRIBUTED = os.path.dirname(os.path.abspath(dist.__file__)) + os.sep


def _raised_in_torch_distributed(error):
    """Whether the innermost frame of ``error``'s traceback is torch.distributed's own code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_TORCH_DISTRIBUTED)


def is_collective_error(error):
    """Whether ``error`` was raised by a collective or the store, rather than by the rank's own code.

    Decided by facts about the exception, its type and where it was raised: torch raises
    :class:`torch.distributed.DistError` (and its subclasses) from the store and from nccl, and gloo a
    plain RuntimeError out of a torch.distributed call; a collective's ``Work`` waited outside
    torch.distributed (``GradientBuckets``) re-raises gloo's as :class:`torch.distributed.DistBackendError`.
    """
    if isinstance(error, PeerFailedError):
        return False
    if isinstance(error, getattr(dist, 'DistError', ())):
        return True
    return type(error) is RuntimeError and _raised_in_torch_distributed(error)


def _is_timeout(error, silence, limit):
    """Whether a peer fell silent rather than left: torch said so by the error's type, or the heartbeat
    saw a watched peer's beat unchanged for half the rendezvous timeout ``limit`` (``silence``, seconds, or
    None without a heartbeat). A peer that left closed its connection within a beat of its last one."""
    if isinstance(error, getattr(dist, 'DistTimeoutError', ())):
        return True
    return silence is not None and silence > limit / 2


def publish(store, cause):
    """Record ``cause`` in the store, unless another rank's cause is already there.

    Args:
        store (torch.distributed.Store): the job's store
        cause (Cause): what ended the job
    """
    if store is None:
        return
    try:
        store.set_timeout(_SHORT)
        store.compare_set('error', '', cause.to_json())
    except Exception:  # the store is gone with rank 0: nothing to tell
        pass


def wait_until_read(store, world_size, seconds=3.0, skip=None):
    """On rank 0, which hosts the store: wait (at most ``seconds``) until every other live rank has
    read the cause, so that they can report it before the store goes away with this process.

    Each reader marks itself by its rank (:func:`read_cause`'s ``reader``), so that rank 0's own reads,
    and a rank that reads twice (its heartbeat and its main thread), count for nobody else.
    ``skip`` is the rank the cause names, which will not read it (it published it, died or fell silent).
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gone = set(_peers.dead_local_ranks()) | {skip}
        keys = ['error_seen/{}'.format(r) for r in range(1, world_size) if r not in gone]
        try:
            if not keys or store.check(keys):
                return
        except Exception:
            return
        time.sleep(0.05)


def read_cause(store, wait=0.0, deaths=True, reader=None):
    """Poll the store for up to ``wait`` s: the published cause, or (with ``deaths``) one naming a peer
    of this machine that died without publishing one.

    Args:
        reader (int): this rank, marked in the store as having read the cause (see :func:`wait_until_read`)

    Returns:
        Cause or None: None when neither appears

    Raises:
        Exception: the store itself stopped answering
    """
    store.set_timeout(_SHORT)
    deadline = time.monotonic() + wait
    while True:
        dead = _peers.dead_local_ranks() if deaths else []
        if store.check(['error']):
            cause = Cause.from_json(store.get('error').decode())
            if reader is not None:
                store.set('error_seen/{}'.format(reader), '1')
            return cause
        if dead:  # checked after the key: a rank publishes before it exits
            return died(dead)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def died(ranks):
    """The :class:`Cause` for peers of this machine whose processes are gone without a word."""
    return Cause(ranks[0], PEER, '', 'rank {} died without reporting an error: it was killed (by the OOM '
                                     'killer, or a signal) or crashed in native code; see its log and '
                                     'dmesg'.format(', '.join(map(str, ranks))))


def master_gone(env):
    """The :class:`Cause` for a store that stopped answering: rank 0's process or host is gone."""
    return Cause(0, PEER, '', 'rank 0 (the master at {}) is gone: its process died or its host became '
                              'unreachable; see rank 0\'s log for its error'.format(env.address))


def silent(env, who, seconds):
    """The :class:`Cause` for a collective in which ``who`` (a rank, or words) sent nothing for ``seconds``."""
    return Cause(who if isinstance(who, int) else -1, NETWORK, '', 'no answer from {} for {:g} s: its host is down, '
                 'the network is partitioned, or it is stuck outside the training loop; check that host, or raise '
                 'timeout= if a step can take that long'.format(
                     'rank {}'.format(who) if isinstance(who, int) else who, seconds))


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


def cause_of(verdict, env):
    """The :class:`Cause` for a heartbeat's :class:`~torchbearer_dist.runtime._verdict.Verdict`.

    Args:
        verdict (Verdict): what the heartbeat judged
        env (DistEnv): this process's place in the job

    Returns:
        Cause or None: None for a cause another rank published (read it from the store)
    """
    if verdict.kind == _verdict.PUBLISHED:
        return None
    if verdict.kind == _verdict.FROZEN:
        return frozen(verdict.rank, verdict.seconds, env.meet_timeout.total_seconds())
    if verdict.kind == _verdict.DIED:
        return died([verdict.rank])
    if verdict.kind == _verdict.MASTER_SILENT:
        return master_silent(env, verdict.seconds)
    return no_heartbeat(verdict.rank, verdict.seconds)


def is_guess(cause):
    """Whether ``cause`` names a rank less surely than a rank's own report, a death seen in the process
    table or a refused connection could: a silence (the network's kind), or :attr:`Cause.guess`."""
    return cause.kind == NETWORK or cause.guess


_CLOSED = 'closed its connection without reporting an error'


def diagnose(store, env, error, silence=None):
    """Explain what ``error`` means for the job: this rank's own failure, or another rank's.

    A collective error is explained by the cause another rank published (waited for at most 3 s),
    by a peer of this machine that died, or, failing both, by how the collective failed (a peer fell
    silent, torch's timeout error or the heartbeat's ``silence`` says; else a peer left, closing its
    connection). Anything else is this rank's own error.

    Args:
        store (torch.distributed.Store): the job's store
        env (DistEnv): this process's place in the job
        error (BaseException): what this rank caught
        silence (float): seconds the heartbeat last saw a watched peer's beat unchanged
            (:meth:`~torchbearer_dist.runtime._watchdog.Watchdog.silence`); None without a heartbeat

    Returns:
        tuple: ``(cause, own)``: the :class:`Cause` to report, and whether it is this rank's own
    """
    if not is_collective_error(error):
        return own_cause(env.rank, error), True
    timed_out = _is_timeout(error, silence, env.meet_timeout.total_seconds())
    reachable = 'ok' if env.rank == 0 else _peers.probe(env.host, env.port)
    if reachable == 'refused':
        return master_gone(env), False
    if reachable == 'ok':  # a store call to a silent host could block past any timeout
        try:
            # After a timeout the peer was silent for that long: whatever it did since is no cause.
            cause = read_cause(store, 1.0 if timed_out else 3.0, deaths=not timed_out, reader=env.rank)
            if cause is not None:
                return cause, cause.rank == env.rank and cause.kind == LOCAL
        except Exception:  # the store stopped answering: it lives in rank 0
            if env.rank != 0 and not timed_out:
                return master_gone(env), False
    others = [r for r in range(env.world_size) if r != env.rank]
    who = others[0] if len(others) == 1 else 'a peer rank'
    if timed_out:
        return silent(env, who, env.timeout.total_seconds()), False
    return Cause(who if isinstance(who, int) else -1, PEER, '', ('{} ' + _CLOSED + ': it exited or was killed; '
                 'see its log').format(
                     'rank {}'.format(who) if isinstance(who, int) else who), guess=True), False
