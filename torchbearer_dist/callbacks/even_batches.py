"""Equal batch counts on every rank each epoch."""
import warnings

import torchbearer
from torchbearer import Callback

from torchbearer_dist.sync import collectives


class EvenBatches(Callback):
    """Make every rank run the same number of training batches each epoch.

    Ranks whose loaders differ in length (a non-padding sampler, datasets of different sizes) would
    otherwise leave the longer rank waiting in a collective until the timeout, while the shorter
    one exits cleanly. One all-reduce per epoch compares the counts.

    Example: ::

        >>> from torchbearer_dist import EvenBatches
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[EvenBatches(policy='error')])

    Args:
        policy (str): ``'min'`` (every rank stops at the shortest count, said once) or ``'error'``
            (every rank raises before the first step, naming both counts)

    Raises:
        ValueError: an unknown policy, or with ``policy='error'`` unequal counts

    .. warning:: A synchronization point at each epoch start.
    """

    def __init__(self, policy='min'):
        super().__init__()
        if policy not in ('min', 'error'):
            raise ValueError("policy should be 'min' or 'error', but given {!r}".format(policy))
        self.policy = policy
        self._warned = False

    def on_start_training(self, state):
        steps = state[torchbearer.STEPS]
        if collectives.world_size() == 1 or steps is None or steps < 0:
            return
        fewest, most = collectives.reduce_int(steps, 'min'), collectives.reduce_int(steps, 'max')
        if fewest == most:
            return
        if self.policy == 'error':
            raise ValueError('ranks have unequal numbers of training batches (fewest {}, most {}; this rank {}); '
                             'use a DistributedSampler, or EvenBatches(policy="min")'.format(fewest, most, steps))
        if not self._warned and collectives.rank() == 0:
            warnings.warn('ranks have unequal numbers of training batches (fewest {}, most {}): every rank stops '
                          'after {} this epoch'.format(fewest, most, fewest), stacklevel=2)
        self._warned = True
        state[torchbearer.STEPS] = fewest
