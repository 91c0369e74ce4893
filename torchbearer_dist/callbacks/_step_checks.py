"""What every rank checks after a step's gradients are averaged: the part of
:class:`~torchbearer_dist.AllReduceGradients` that skips or raises on non-finite averages, notices gradients
no hook saw, and runs the divergence sentinel.
"""
import warnings

import torch
import torchbearer

from torchbearer_dist.callbacks import _held
from torchbearer_dist.sync import collectives, models

#: State key: how many steps were skipped because the averaged gradients were not finite.
SKIPPED_STEPS = torchbearer.state_key('skipped_steps')


class StepChecks:
    """The checks of a step, an object of :class:`~torchbearer_dist.AllReduceGradients`: the divergence sentinel
    and the non-finite average's skip or stop, counting the steps it skipped.

    Args:
        check_divergence (bool): run the divergence sentinel
        on_nonfinite (str): ``'skip'`` or ``'raise'``: what a non-finite average does
    """

    def __init__(self, check_divergence=True, on_nonfinite='skip'):
        self.check_divergence, self.on_nonfinite = check_divergence, on_nonfinite
        self.skipped = 0  # steps skipped for a non-finite average, over this object's life

    def divergence(self, state, buffers, steps):
        """The divergence sentinel at training step ``steps`` of the run: every rank raises, naming the tensor and
        the step, if the replicas differ; ``buffers``: the buffers too (at the end of a pass)."""
        if not self.check_divergence or collectives.world_size() == 1:
            return
        entries = _held.synchronised(state)
        if not buffers:  # within a pass each rank's buffers (BatchNorm statistics) follow its own batches
            entries = [(name, t) for name, t in entries if isinstance(t, torch.nn.Parameter)]
        differing = models.differing_tensors(entries)
        if differing:
            where = 'after the first step' if not buffers else 'at the end of the training pass'
            raise RuntimeError("replicas diverged {} (epoch {}, step {}): '{}' differs across ranks ({} of {} tensors "
                               "differ); something updated it on one rank only, such as an optimizer or module that "
                               "trial.state does not hold (store it there) or a callback that edits weights on one "
                               "rank; AllReduceGradients(check_divergence=False) turns this check off".format(
                                   where, state.get(torchbearer.EPOCH), steps, differing[0], len(differing),
                                   len(entries)))

    def step(self, state, buckets):
        """After ``buckets`` averaged a step's gradients: raise where gradients escaped them, or where the average
        is not finite and ``on_nonfinite='raise'``; else count a skipped step in ``state[SKIPPED_STEPS]``."""
        if buckets.missed():
            raise RuntimeError('gradients were computed without passing through the output of state[MODEL], so they '
                               'were not averaged; pass overlap=True to AllReduceGradients')
        if not buckets.synced or not buckets.nonfinite:
            return
        if self.on_nonfinite == 'raise':
            raise RuntimeError('the averaged gradients hold NaN or Inf at epoch {}, batch {} (on every rank); '
                               'lower the learning rate, or pass on_nonfinite="skip" to skip such steps'.format(
                                   state[torchbearer.EPOCH], state[torchbearer.BATCH]))
        buckets.nonfinite = False  # counted once, whether on_backward runs or not
        self.skipped += 1
        state[SKIPPED_STEPS] = self.skipped
        if self.skipped == 1 and collectives.rank() == 0:
            warnings.warn('averaged gradients hold NaN or Inf: every rank skips this step; skipped steps are '
                          'counted in state[torchbearer_dist.SKIPPED_STEPS]', stacklevel=2)
