"""The exception a rank raises when another rank failed first, and the one of a pre-empted rank; the one
line an uncaught :class:`PeerFailedError` prints instead of its traceback, where a program asks for it."""
import os
import sys


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed first; the message names that rank and its error.

    Attributes:
        rank (int or None): the rank that failed first
        kind (str or None): ``'local'`` (its own error), ``'peer'`` (it died or left) or ``'network'``
        exc_type (str or None): the name of its exception type, when it reported one
    """

    def __init__(self, message, rank=None, kind=None, exc_type=None):
        super().__init__(message)
        self.rank, self.kind, self.exc_type = rank, kind, exc_type

    def __reduce__(self):
        return type(self), (self.args[0], self.rank, self.kind, self.exc_type)

    @classmethod
    def from_cause(cls, cause, rank):
        """The error rank ``rank`` raises for another rank's ``cause`` (a ``_diagnosis.Cause``), e.g.
        ``rank 1 failed: ValueError: bad batch (rank 0 stopped)``."""
        return cls('{} (rank {} stopped)'.format(cause.line(), rank), cause.rank, cause.kind, cause.exc_type or None)


class GlooConnectError(RuntimeError):
    """gloo on this rank could not connect to the other ranks while the group was created; the message names
    the interface it used and what to set. Raised where the heartbeat found no peer at fault (else the peer is
    named: the rule is :func:`~torchbearer_dist.runtime._decision.decide`'s)."""


#: The exit status of a rank that stopped for a pre-emption after its step checkpoint was written: ``EX_TEMPFAIL``
#: of ``sysexits.h``, "the user is invited to retry": run the same command again to go on from that checkpoint.
EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """Training stopped for a pre-emption signal (SIGTERM, SIGUSR1) and can resume from its checkpoint.

    A :class:`SystemExit` whose ``code`` is :data:`EXIT_PREEMPTED` (75): uncaught, it ends the process with
    that status and no traceback. Raised by ``trial.run`` on every rank once the :class:`~torchbearer_dist.Checkpoint`
    callback has written its step checkpoint, and by the signal handler itself where no Trial is training.
    """

    def __init__(self, message='pre-empted; resumable from the last checkpoint'):
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self):
        return self.message


#: Set to ``1`` to see the whole traceback of a :class:`~torchbearer_dist.PeerFailedError` nobody caught.
TRACEBACK_VARIABLE = 'TORCHBEARER_DIST_TRACEBACK'


def quiet_peer_failures(on=True):
    """Make an uncaught :class:`~torchbearer_dist.PeerFailedError` print its one line, not a traceback.

    Opt-in, for a program that owns its process (a command line script). Its traceback shows only where this
    rank was when a peer failed (40 to 60 lines of torchbearer and torch); the line names the rank at fault
    and its error. Every other exception reaches the hook that was there before untouched;
    ``TORCHBEARER_DIST_TRACEBACK=1`` shows the whole traceback.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> tbd.quiet_peer_failures()
        >>> tbd.quiet_peer_failures(False)

    Args:
        on (bool): True to install the hook (once), False to give back the hook it replaced
    """
    hook = sys.excepthook
    replaced = getattr(hook, '_torchbearer_dist', None)
    if not on and replaced is not None:
        sys.excepthook = replaced
    if not on or replaced is not None:
        return

    def excepthook(kind, value, traceback):
        if issubclass(kind, PeerFailedError) and os.environ.get(TRACEBACK_VARIABLE) != '1':
            sys.stderr.write('{}: {} (set {}=1 for the traceback)\n'.format(kind.__name__, value,
                                                                           TRACEBACK_VARIABLE))
            sys.stderr.flush()
            return
        hook(kind, value, traceback)

    excepthook._torchbearer_dist = hook  # the hook it replaced, given back by quiet_peer_failures(False)
    sys.excepthook = excepthook
