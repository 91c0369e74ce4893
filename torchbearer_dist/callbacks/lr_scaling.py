"""Learning rate that follows the global batch: the linear scaling rule with gradual warm-up.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour": when the batch
grows k times, multiply the learning rate by k, ramping the factor linearly from 1 to k over the
first epochs so that early steps stay stable.
"""
import torchbearer
from torchbearer import Callback

from torchbearer_dist.sync import collectives

#: State key: the factor :class:`ScaleLearningRate` applies to the learning rate at this step.
LR_FACTOR = torchbearer.state_key('lr_factor')


def _is_count(value, kind=int):
    return isinstance(value, kind) and not isinstance(value, bool)


class ScaleLearningRate(Callback):
    """Scale every param group's learning rate by the growth of the global batch, with linear warm-up.

    The factor is ``k = world_size`` by default, or ``k = global_batch / reference_batch_size``
    where the global batch is the sum of every rank's ``batch_size``. At optimizer step ``t`` it is
    ``1 + (k - 1) * min(1, t / warmup)``, with ``t`` counted in epochs (``epoch + batch / steps``)
    or in steps (``epoch * steps + batch``); without warm-up it is ``k`` from the first step.

    It scales what your schedulers set instead of fighting them: ``param_group['lr']`` holds the
    one-process learning rate at all times except during the optimizer step, where it holds that
    value times the factor. The factor is applied at each step start (``on_sample``) to whatever
    value the group then holds, so a scheduler's latest write, whenever it happened, is the base;
    an optimizer step hook restores the unscaled value as soon as the step ends, before any
    ``on_step_training`` callback runs. Torch and torchbearer schedulers (``StepLR``, ``LambdaLR``, ...)
    thus see and set unscaled values in any callback order, and checkpoints hold unscaled values, so
    they resume on any world size. The factor in use is in ``state[torchbearer_dist.LR_FACTOR]``.

    The trade-off: N ranks that keep the per-rank batch take N times fewer steps per epoch. Scaling
    the learning rate by N keeps the ratio of learning rate to batch, so for small N the run
    reproduces the quality of one process at the per-rank batch (see the "BatchNorm and learning
    rate on several ranks" page for figures on the MNIST example); keeping the learning rate is a
    different, smaller-step training that may be better or worse. For large k the rule breaks down
    (Goyal et al. saw it hold up to a global batch of 8k on ImageNet); warm-up is what keeps the
    first steps from diverging.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer.callbacks import StepLR
        >>> from torchbearer_dist import ScaleLearningRate
        >>> callbacks = [ScaleLearningRate(warmup_epochs=2), StepLR(10)]
        >>> trial = Trial(model, optimizer, loss, callbacks=callbacks)

    Args:
        reference_batch_size (int): the batch your learning rate was tuned for; scale by the global
            batch relative to it. Default ``None``: scale by the world size
        batch_size (int): this rank's batch size, needed with ``reference_batch_size``; by default the
            training loader's ``batch_size``
        warmup_epochs (float): epochs over which the factor ramps from 1 to k
        warmup_steps (int): optimizer steps over which the factor ramps from 1 to k (instead of epochs)

    Raises:
        ValueError: a bad argument, both warm-ups given, or no batch size to be found

    State Requirements:
        - :attr:`torchbearer.state.OPTIMIZER`: the optimizer whose param groups are scaled
        - :attr:`torchbearer.state.EPOCH`, :attr:`torchbearer.state.BATCH`, :attr:`torchbearer.state.STEPS`:
          where training is, for the warm-up

    .. warning:: With ``reference_batch_size``, a synchronization point on ``on_start`` (one
        all-reduce of the batch sizes): every rank must run it.
    """

    def __init__(self, reference_batch_size=None, batch_size=None, warmup_epochs=0, warmup_steps=0):
        super().__init__()
        for name, value in (('reference_batch_size', reference_batch_size), ('batch_size', batch_size)):
            if value is not None and (not _is_count(value) or value < 1):
                raise ValueError('{} should be a positive integer or None, but given {!r}'.format(name, value))
        if not _is_count(warmup_epochs, (int, float)) or warmup_epochs < 0:
            raise ValueError('warmup_epochs should be a number >= 0, but given {!r}'.format(warmup_epochs))
        if not _is_count(warmup_steps) or warmup_steps < 0:
            raise ValueError('warmup_steps should be an integer >= 0, but given {!r}'.format(warmup_steps))
        if warmup_epochs and warmup_steps:
            raise ValueError('give warmup_epochs or warmup_steps, not both (given {} and {})'.format(
                warmup_epochs, warmup_steps))
        self.reference_batch_size = reference_batch_size
        self.batch_size = batch_size
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.scale = 1.0
        self._applied = []
        self._hook = None

    def on_start(self, state):
        self._release()
        self.scale = float(collectives.world_size())
        if self.reference_batch_size is not None:
            batch_size = self.batch_size
            if batch_size is None:
                batch_size = getattr(state[torchbearer.TRAIN_GENERATOR], 'batch_size', None)
            if not _is_count(batch_size):
                raise ValueError('ScaleLearningRate(reference_batch_size={}) cannot find this rank\'s batch size '
                                 '(the training loader gives {!r}); pass batch_size='.format(
                                     self.reference_batch_size, batch_size))
            self.scale = collectives.reduce_int(batch_size, 'sum') / self.reference_batch_size
        optimizer = state[torchbearer.OPTIMIZER]
        if hasattr(optimizer, 'register_step_post_hook'):
            self._hook = optimizer.register_step_post_hook(lambda *_: self._restore())
        state[LR_FACTOR] = 1.0

    def factor(self, epoch, batch, steps):
        """The factor at a step.

        Args:
            epoch (int): the epoch, from 0
            batch (int): the step within the epoch, from 0
            steps (int): steps per epoch

        Returns:
            float: ``1 + (k - 1) * min(1, t / warmup)``, or ``k`` without warm-up
        """
        if self.warmup_steps:
            progress = (epoch * steps + batch) / self.warmup_steps
        elif self.warmup_epochs:
            progress = (epoch + batch / steps) / self.warmup_epochs
        else:
            progress = 1.0
        return 1.0 + (self.scale - 1.0) * min(1.0, progress)

    def on_start_training(self, state):
        steps = state[torchbearer.STEPS]
        if (self.warmup_steps or self.warmup_epochs) and not (steps is not None and steps > 0):
            raise ValueError('ScaleLearningRate warm-up needs a known number of steps per epoch, but given {!r}; '
                             'use for_train_steps(n) or a loader with a length'.format(steps))

    def on_sample(self, state):
        factor = self.factor(state[torchbearer.EPOCH], state[torchbearer.BATCH], state[torchbearer.STEPS])
        self._restore()  # an optimizer without step hooks: undo the last step's scaling here
        self._applied = []
        for group in state[torchbearer.OPTIMIZER].param_groups:
            base = group['lr']
            group['lr'] = base * factor
            self._applied.append((group, base, group['lr']))
        state[LR_FACTOR] = factor

    def _restore(self):
        for group, base, scaled in self._applied:
            if group['lr'] == scaled:  # left alone during the step; anything else is someone's new base
                group['lr'] = base
        self._applied = []

    def on_step_training(self, state):
        self._restore()  # a no-op after the step hook; without one, restores before later callbacks

    def on_end(self, state):
        self._release()

    def _release(self):
        self._restore()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

