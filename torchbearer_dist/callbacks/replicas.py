"""A periodic check that the replicas still hold the same values."""
import torchbearer
from torchbearer import Callback

from torchbearer_dist.sync.models import check_replicas, unwrap


class CheckReplicas(Callback):
    """Check every ``every`` steps that parameters agree across ranks, and buffers too at each epoch end.

    One small all-reduce of two checksums per tensor; on a difference every rank raises, naming the
    first tensor that differs. Catches an update made on one rank only (a callback that touches the
    model locally, a buffer that drifts). Buffers such as BatchNorm statistics are compared only at
    the epoch end, after :class:`AllReduceGradients` has re-broadcast them from rank 0.

    Example: ::

        >>> from torchbearer_dist import CheckReplicas
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[CheckReplicas(every=100)])

    Args:
        every (int): steps between checks; also checked at each epoch end

    Raises:
        ValueError: ``every`` is not a positive integer; at the start of a run, the Trial also holds
            :class:`DiLoCo`, whose ranks hold different weights between meetings by design (it
            compares the replicas at every meeting itself)

    .. warning:: A synchronization point every ``every`` steps.
    """

    def __init__(self, every=100):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError('every should be an integer >= 1, but given {!r}'.format(every))
        self.every = every
        self._steps = 0

    def on_start(self, state):
        from torchbearer_dist.callbacks._stop_agreement import callback_list
        from torchbearer_dist.callbacks.low_communication import DiLoCo
        if any(isinstance(c, DiLoCo) for c in callback_list(state)):  # the first check would stop the run: say why
            raise ValueError("CheckReplicas(every={}) would compare weights that DiLoCo's ranks hold apart between "
                             "meetings by design; drop CheckReplicas: DiLoCo compares the replicas at every meeting "
                             "(check_divergence=True)".format(self.every))

    def on_step_training(self, state):
        self._steps += 1
        if self._steps % self.every == 0:
            check_replicas(unwrap(state[torchbearer.MODEL]), buffers=False)

    def on_end_epoch(self, state):
        check_replicas(unwrap(state[torchbearer.MODEL]))
