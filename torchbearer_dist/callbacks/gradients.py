"""Gradient averaging in a Trial: :class:`AllReduceGradients`, a thin callback over the bucket engine.

The engine, :mod:`torchbearer_dist.sync.buckets`, needs no torchbearer.
"""
import warnings
import weakref

import torch
import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks.stop import AgreeOnStop
from torchbearer_dist.sync import collectives, models
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import check_options, check_supported

#: State key: how many steps were skipped because the averaged gradients were not finite.
SKIPPED_STEPS = torchbearer.state_key('skipped_steps')


def loss_is_summed(state, loss_reduction):
    """Whether the Trial's loss is a sum over the batch: ``loss_reduction``, or for ``'auto'`` the criterion's own.

    ``'auto'`` recognises a torch loss module with ``reduction='sum'``; a loss function it cannot
    inspect counts as a mean, as one process at N x B averages over its batch.
    """
    if loss_reduction != 'auto':
        return loss_reduction == 'sum'
    criterion = state.get(torchbearer.CRITERION)
    return isinstance(criterion, torch.nn.Module) and getattr(criterion, 'reduction', None) == 'sum'


def check_loss_reduction(loss_reduction):
    """Raise ValueError, naming the value, unless ``loss_reduction`` is 'auto', 'mean' or 'sum'."""
    if loss_reduction not in ('auto', 'mean', 'sum'):
        raise ValueError("loss_reduction should be 'auto', 'mean' or 'sum', but given {!r}".format(loss_reduction))


class AllReduceGradients(Callback):
    """Average every gradient over all ranks, complete when backward returns.

    Gradients are fused into flat buckets (see :class:`~torchbearer_dist.sync.buckets.GradientBuckets`)
    whose average is complete before ``backward()`` returns, so every ``on_backward`` callback,
    wherever it sits in the list (GradientNormClipping, gradient logging), sees averaged gradients,
    with the standard closure, a custom closure or ``Trial.with_closure``.

    **Every model and optimizer the Trial holds.** The gradients of every parameter that any
    optimizer in the Trial's state steps are averaged, under whatever key the program keeps it (a
    GAN's discriminator and its optimizer, a learnable loss term), whichever backward pass produced
    them: each backward pass of a step (a closure that runs two) is averaged when it returns. A gradient that is None on
    this rank is zero-filled so that every rank issues the same collectives; frozen parameters are
    left alone. Sparse gradients are averaged (as dense, handed back sparse); complex parameters
    too. The averaged gradients are checked for NaN and Inf on every rank alike.

    Collectives run only inside the Trial's training steps: a backward outside them (after a run,
    or after a run that raised) stays local.

    It also makes every rank stop at the same step when a callback on any rank sets
    ``state[torchbearer.STOP_TRAINING]`` (TerminateOnNaN, EarlyStopping): the request travels with
    the next step's gradients, at no extra cost (see :class:`AgreeOnStop`).

    At the end of each training pass it copies rank 0's buffers (BatchNorm running statistics), which
    each rank updates from its own batches, to every rank (for every module in the Trial's state):
    validation, checkpoints and :class:`CheckReplicas` then see one model.

    **Divergence sentinel.** After the first step of each run and at the end of every training pass,
    the ranks compare a fingerprint of every synchronised parameter and buffer (two integers per
    tensor, one collective of eight integers when they agree). Should anything escape the
    synchronisation (a module stepped by an optimizer the state does not hold, a callback that
    edits weights on one rank), every rank raises, naming the tensor and the step, within one epoch
    instead of training a silently different model.

    **Summed losses.** A loss that is a sum over the batch (a torch loss module with
    ``reduction='sum'``, recognised; or ``loss_reduction='sum'``) has its gradients summed over
    ranks instead of averaged: one process at N x B sums over all N x B samples.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import AllReduceGradients
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[AllReduceGradients()])

    Args:
        bucket_cap_mb (float): capacity of a gradient bucket in MiB
        first_bucket_mb (float): capacity of the first bucket sent, small so sending starts early
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in; or
            ``'powersgd'``: gradient matrices travel as rank-``powersgd_rank`` factors with error
            feedback (see :class:`~torchbearer_dist.PowerSGD`), for links slower than the compute;
            the average is then approximate, the replicas still identical; it runs at the end of
            backward (``overlap`` does not apply) and needs parameters of one floating dtype
        powersgd_rank (int): with ``compression='powersgd'``, the rank of the approximation
        powersgd_start_iter (int): with ``compression='powersgd'``, how many first steps are averaged
            uncompressed (by default 2: compression starts at the third step)
        sync_every (int): all-reduce only on every k-th backward, for gradient accumulation; the
            backward passes in between stay local (like DDP's ``no_sync``). The optimizer must then
            step only after the k-th backward and keep gradients in between, as an accumulating
            optimizer wrapper or closure does; a plain Trial steps on every batch, and its replicas
            would drift apart on the local gradients
        on_nonfinite (str): ``'skip'`` (every rank skips the optimizer step and counts it in
            :data:`SKIPPED_STEPS`) or ``'raise'`` (every rank stops with an error)
        overlap (bool or str): ``True`` starts each bucket's all-reduce from autograd hooks during
            backward; ``False`` copies every gradient in with one fused copy per bucket at the end of
            backward; ``'auto'`` overlaps only when the gradients span more than one bucket (a single
            bucket cannot overlap anything, and the hooks cost Python time per parameter)
        check_divergence (bool): compare the replicas after the first step and at the end of every
            training pass (the divergence sentinel); ``False`` turns it off
        loss_reduction (str): ``'auto'`` (a torch loss module with ``reduction='sum'`` is summed, any
            other loss averaged), ``'mean'`` or ``'sum'``: how the loss combines its samples, and so
            how gradients combine over ranks

    Raises:
        ValueError: a bad option; at the start of a run, a parameter that cannot be averaged (named)
        RuntimeError: the divergence sentinel found a tensor that differs across ranks (named, with the step)

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model whose gradients are averaged
        - :attr:`torchbearer.state.OPTIMIZER`: its parameters outside the model are averaged too
        - any other key holding an ``nn.Module`` or an optimizer: their parameters are averaged and
          compared too
        - :attr:`torchbearer.state.CRITERION`: read for its ``reduction``

    .. warning:: A synchronization point on every backward: every rank must run the same number of
        steps (see :class:`EvenBatches`).
    """

    def __init__(self, bucket_cap_mb=25.0, first_bucket_mb=1.0, compression=None, sync_every=1,
                 on_nonfinite='skip', overlap='auto', powersgd_rank=4, powersgd_start_iter=2, check_divergence=True,
                 loss_reduction='auto'):
        super().__init__()
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError('sync_every should be an integer >= 1, but given {!r}'.format(sync_every))
        if on_nonfinite not in ('skip', 'raise'):
            raise ValueError("on_nonfinite should be 'skip' or 'raise', but given {!r}".format(on_nonfinite))
        check_options(bucket_cap_mb, compression, overlap)
        for name, value, low in (('powersgd_rank', powersgd_rank, 1), ('powersgd_start_iter', powersgd_start_iter, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError('{} should be an integer >= {}, but given {!r}'.format(name, low, value))
        if not isinstance(check_divergence, bool):
            raise ValueError('check_divergence should be True or False, but given {!r}'.format(check_divergence))
        check_loss_reduction(loss_reduction)
        self.options = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compression=compression,
                            overlap=overlap, sync_every=sync_every)
        if compression == 'powersgd':
            self.options['powersgd'] = dict(matrix_approximation_rank=powersgd_rank, start_iter=powersgd_start_iter)
        self.sync_every = sync_every
        self.on_nonfinite = on_nonfinite
        self.check_divergence = check_divergence
        self.loss_reduction = loss_reduction
        self.skipped = 0
        self.buckets = None
        self._ddp = False
        self._summed = False
        self._steps = 0  # training steps of this run, for the sentinel's first check
        self._owner = None  # weak reference to the state of the run whose training steps are hooked
        # The stop agreement is held, not inherited: its companion calls _after_step after every other callback.
        self._agreement = AgreeOnStop()
        self._agreement.gradients = weakref.proxy(self)

    def on_start(self, state):
        self._steps = 0
        if collectives.world_size() == 1:
            return
        model = state[torchbearer.MODEL]
        if isinstance(model, DistributedDataParallel):
            if not self._ddp:
                warnings.warn('the model is already DistributedDataParallel, which averages gradients itself: '
                              'AllReduceGradients leaves them alone (drop it to silence this warning)', stacklevel=2)
            self._ddp = True
            return
        self._ddp = False
        self._summed = loss_is_summed(state, self.loss_reduction)
        check_supported(_held.trainable(state))  # before any collective of the run

    def on_start_training(self, state):
        self._agreement.on_start_training(state)
        if self.buckets is not None:
            self.buckets.detach()  # hooks of an earlier Trial or run, whatever way it ended
        if collectives.world_size() == 1 or self._ddp:
            self.buckets = None
            return
        params = [p for _, p in _held.trainable(state)]
        options = dict(self.options, average=not self._summed)
        if self.buckets is None or not self.buckets.same_params(params) or self.buckets.average != options['average']:
            self.buckets = GradientBuckets(params, **options) if params else None
        state[SKIPPED_STEPS] = self.skipped
        if self.buckets is None:
            return
        self.buckets.attach([module for _, module in _held.held_modules(state)])
        if self._owner is None or self._owner() is not state:
            # torchbearer skips on_end when run() raises: the hooks also go when this run's state does.
            self._owner = weakref.ref(state)
            weakref.finalize(state, self._expire, weakref.ref(self))

    @staticmethod
    def _expire(ref):
        self = ref()
        if self is not None and self._owner is not None and self._owner() is None and self.buckets is not None:
            self.buckets.detach()

    def on_end(self, state):
        self._agreement.on_end(state)
        # Only the end of the run that attached them: an evaluate() nested in a run leaves them alone.
        if self.buckets is not None and self._owner is not None and self._owner() is state:
            self.buckets.detach()

    def on_sample(self, state):
        if self.buckets is not None:
            self.buckets.arm()

    def on_end_training(self, state):
        if self.buckets is not None:
            self.buckets.disarm()
        if collectives.world_size() > 1 and not self._ddp:
            models.broadcast_buffers_of([module for _, module in _held.held_modules(state)])
            self._check_divergence(state, buffers=True)

    def on_backward(self, state):
        if self.buckets is not None:
            self.buckets.end_backward()
            self._check_step(state)

    def _after_step(self, state):
        """Called by the stop agreement's companion after every other callback of the step."""
        if self.buckets is not None:
            self.buckets.end_backward()
            self._check_step(state)
            self.buckets.disarm()
        self._steps += 1
        if self._steps == 1 and not self._ddp:
            self._check_divergence(state, buffers=False)

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
