"""The exception a rank raises when another rank failed first, and the one of a pre-empted rank."""



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


#: The exit status of a rank that stopped for a pre-emption after its step checkpoint was written:
#: ``EX_TEMPFAIL`` of ``sysexits.h``, "a temporary failure; the user is invited to retry". Run the same
#: command again (or let torchrun or SLURM restart it) and training goes on from that checkpoint.
EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """Training stopped for a pre-emption signal (SIGTERM, SIGUSR1) and can resume from its checkpoint.

    A :class:`SystemExit` whose ``code`` is :data:`EXIT_PREEMPTED` (75): uncaught, it ends the process
    with that status and no traceback. Raised by ``trial.run`` on every rank once the
    :class:`~torchbearer_dist.Checkpoint` callback has written its step checkpoint, and by the signal
    handler itself where no Trial is training.
    """

    def __init__(self, message='pre-empted; resumable from the last checkpoint'):
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self):
        return self.message
