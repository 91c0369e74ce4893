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
    """The checks of a step (a mixin): it reads ``buckets``, ``check_divergence``, ``on_nonfinite`` and
    ``_steps`` of the callback, and counts ``skipped``."""

    def _check_divergence(self, state, buffers):
        """The divergence sentinel: every rank raises, naming the tensor and the step, if the replicas differ."""
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
                                   where, state.get(torchbearer.EPOCH), self._steps, differing[0], len(differing),
                                   len(entries)))

    def _check_step(self, state):
        buckets = self.buckets
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
