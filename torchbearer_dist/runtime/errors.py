"""The exception a rank raises when another rank failed first."""



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
