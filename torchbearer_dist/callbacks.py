"""The synchronizing callbacks: thin torchbearer :class:`~torchbearer.callbacks.Callback` classes over :mod:`.comm`.

Each works with no arguments once the process group is up, and does nothing in a job of one
process, so the same Trial runs unchanged with and without distribution.
"""
import warnings

import torch
import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist import comm
from torchbearer_dist.buckets import GradientBuckets
from torchbearer_dist.consistency import EvenBatches
from torchbearer_dist.data import SetSamplerEpoch
from torchbearer_dist.metrics import ReduceMetrics
from torchbearer_dist.output import RankZeroOutput

#: State key: how many steps were skipped because the averaged gradients were not finite.
SKIPPED_STEPS = torchbearer.state_key('skipped_steps')


class BroadcastParameters(Callback):
    """Copy rank 0's parameters and buffers to every rank when the Trial is created.

    First checks, with one small exchange of a fingerprint, that every rank holds the same
    parameter and buffer names, shapes and dtypes; on a mismatch every rank raises, naming the first
    entry that differs. Values are copied, never averaged.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import BroadcastParameters
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[BroadcastParameters()])

    Args:
        method (str): ``'broadcast'`` (one collective per dtype) or ``'p2p'`` (``send`` from rank 0
            and ``recv`` on the others, as in the PyTorch tutorial)
        src (int): the rank whose values every rank takes

    Raises:
        ValueError: an unknown ``method``

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model to synchronize, set on Trial init

    .. warning:: A synchronization point: every rank must create its Trial.
    """

    def __init__(self, method='broadcast', src=0):
        super().__init__()
        if method not in ('broadcast', 'p2p'):
            raise ValueError("method should be 'broadcast' or 'p2p', but given {!r}".format(method))
        self.method = method
        self.src = src

    def on_init(self, state):
        model = state[torchbearer.MODEL]
        if not isinstance(model, torch.nn.Module) or comm.world_size() == 1:
            return
        comm.check_same_model(model, self.src)
        comm.broadcast_state(model, self.src, self.method)


class AgreeOnStop(Callback):
    """Make every rank stop at the same step when a callback on any rank stops training.

    A callback such as TerminateOnNaN sees only its own rank's loss; if it stopped that rank alone,
    the others would wait for it in their next collective. A stop set in ``on_step_training`` is
    held back and shared with every rank, which all stop after the next step; a stop set at the end
    of an epoch is agreed by one all-reduce. :class:`AllReduceGradients` does this itself, carrying
    the request in its gradient buckets at no cost; use this one with a DistributedDataParallel model.
    Place it after the callbacks that stop training.

    Example: ::

        >>> from torchbearer.callbacks import TerminateOnNaN
        >>> from torchbearer_dist import AgreeOnStop
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[TerminateOnNaN(), AgreeOnStop()])

    State Requirements:
        - :attr:`torchbearer.state.STOP_TRAINING`: read and set

    .. warning:: A synchronization point at each step (without gradient buckets) and each epoch end.
    """

    buckets = None

    def __init__(self):
        super().__init__()
        self._stop_requested = False
        self._stop_agreed = False

    def on_step_training(self, state):
        if comm.world_size() == 1:
            return
        if state[torchbearer.STOP_TRAINING] and not self._stop_agreed:
            # Hold the stop until every rank knows: it travels with the next step's gradients.
            state[torchbearer.STOP_TRAINING] = False
            self._stop_requested = True
            if self.buckets is not None:
                self.buckets.request_stop()
        if self.buckets is None and comm.any_rank(self._stop_requested):
            self._stop_requested = False
            state[torchbearer.STOP_TRAINING] = True

    def on_end_training(self, state):
        self._agree_on_stop(state, self._stop_requested)

    def on_checkpoint(self, state):
        self._agree_on_stop(state, state[torchbearer.STOP_TRAINING])

    def _agree_on_stop(self, state, flag):
        if comm.world_size() == 1:
            return
        if comm.any_rank(flag or state[torchbearer.STOP_TRAINING]):
            state[torchbearer.STOP_TRAINING] = True
        self._stop_requested = self._stop_agreed = False


class AllReduceGradients(AgreeOnStop):
    """Average every gradient over all ranks after each backward pass.

    Gradients are fused into flat buckets whose all-reduce starts during backward, as soon as each
    bucket is full (see :class:`~torchbearer_dist.buckets.GradientBuckets`). A gradient that is None
    on this rank is zero-filled so that every rank issues the same collectives; frozen parameters are
    left alone. The averaged gradients are checked for NaN and Inf on every rank alike.

    It also makes every rank stop at the same step when a callback on any rank sets
    ``state[torchbearer.STOP_TRAINING]`` (TerminateOnNaN, EarlyStopping): the request travels with
    the next step's gradients, at no extra cost. Place this callback after callbacks that stop training.

    At the end of each training pass it copies rank 0's buffers (BatchNorm running statistics), which
    each rank updates from its own batches, to every rank, as DDP does before each forward: validation,
    checkpoints and :class:`CheckReplicas` then see one model.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import AllReduceGradients
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[AllReduceGradients()])

    Args:
        bucket_cap_mb (float): capacity of a gradient bucket in MiB
        first_bucket_mb (float): capacity of the first bucket sent, small so sending starts early
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in
        sync_every (int): all-reduce only on every k-th backward, for gradient accumulation; the
            backward passes in between stay local (like DDP's ``no_sync``). The optimizer must then
            step only after the k-th backward and keep gradients in between, as an accumulating
            optimizer wrapper or closure does; a plain Trial steps on every batch, and its replicas
            would drift apart on the local gradients
        on_nonfinite (str): ``'skip'`` (every rank skips the optimizer step and counts it in
            :data:`SKIPPED_STEPS`) or ``'raise'`` (every rank stops with an error)
        overlap (bool or str): ``True`` starts each bucket's all-reduce from autograd hooks during
            backward; ``False`` copies every gradient in with one fused copy per bucket after backward;
            ``'auto'`` overlaps only when the gradients span more than one bucket (a single bucket
            cannot overlap anything, and the hooks cost Python time per parameter)

    Raises:
        ValueError: a bad option

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model whose gradients are averaged

    .. warning:: A synchronization point on every backward: every rank must run the same number of
        steps (see :class:`EvenBatches`).
    """

    def __init__(self, bucket_cap_mb=25.0, first_bucket_mb=1.0, compression=None, sync_every=1,
                 on_nonfinite='skip', overlap='auto'):
        super().__init__()
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError('sync_every should be an integer >= 1, but given {!r}'.format(sync_every))
        if on_nonfinite not in ('skip', 'raise'):
            raise ValueError("on_nonfinite should be 'skip' or 'raise', but given {!r}".format(on_nonfinite))
        if not (isinstance(overlap, bool) or overlap == 'auto'):
            raise ValueError("overlap should be True, False or 'auto', but given {!r}".format(overlap))
        self.options = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compression=compression,
                            overlap=overlap)
        if compression not in (None, 'none', 'fp16', 'bf16'):
            raise ValueError("compression should be None, 'fp16' or 'bf16', but given {!r}".format(compression))
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError('bucket_cap_mb should be a positive number of MiB, but given {!r}'.format(bucket_cap_mb))
        self.sync_every = sync_every
        self.on_nonfinite = on_nonfinite
        self.skipped = 0
        self._backwards = 0
        self._ddp = False

    def on_start(self, state):
        if comm.world_size() == 1:
            return
        model = state[torchbearer.MODEL]
        if isinstance(model, DistributedDataParallel):
            if not self._ddp:
                warnings.warn('the model is already DistributedDataParallel, which averages gradients itself: '
                              'AllReduceGradients leaves them alone (drop it to silence this warning)', stacklevel=2)
            self._ddp = True
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if self.buckets is None or self.buckets.params != params:
            if self.buckets is not None:
                self.buckets.detach()
            self.buckets = GradientBuckets(params, **self.options) if params else None
        if self.buckets is not None:
            self.buckets.attach()
            self.buckets.enabled = self.sync_every == 1
        state[SKIPPED_STEPS] = self.skipped

    def on_end(self, state):
        if self.buckets is not None:
            self.buckets.detach()

    def on_end_training(self, state):
        super().on_end_training(state)
        if comm.world_size() > 1 and not self._ddp:
            comm.broadcast_buffers(state[torchbearer.MODEL])

    def on_backward(self, state):
        if self.buckets is None:
            return
        self._backwards += 1
        if self._backwards % self.sync_every:
            self.buckets.enabled = (self._backwards + 1) % self.sync_every == 0
            return
        self.buckets.enabled = self.sync_every == 1
        if self.buckets.finish():
            self._stop_requested, self._stop_agreed = False, True
            state[torchbearer.STOP_TRAINING] = True
        if not self.buckets.all_finite():
            if self.on_nonfinite == 'raise':
                raise RuntimeError('the averaged gradients hold NaN or Inf at epoch {}, batch {} (on every rank); '
                                   'lower the learning rate, or pass on_nonfinite="skip" to skip such steps'.format(
                                       state[torchbearer.EPOCH], state[torchbearer.BATCH]))
            self.buckets.clear()
            self.skipped += 1
            state[SKIPPED_STEPS] = self.skipped
            if self.skipped == 1 and comm.rank() == 0:
                warnings.warn('averaged gradients hold NaN or Inf: every rank skips this step; skipped steps are '
                              'counted in state[torchbearer_dist.SKIPPED_STEPS]', stacklevel=2)

class FlattenImages(Callback):
    """Reshape each batch of inputs to ``(batch, -1)``, in training, validation and test alike.

    Example: ::

        >>> from torchbearer_dist import FlattenImages
        >>> trial = Trial(torch.nn.Linear(784, 10), callbacks=[FlattenImages()])

    State Requirements:
        - :attr:`torchbearer.state.X`: the input batch
    """

    @staticmethod
    def _flatten(state):
        x = state[torchbearer.X]
        state[torchbearer.X] = x.reshape(x.size(0), -1)

    def on_sample(self, state):
        self._flatten(state)

    def on_sample_validation(self, state):
        self._flatten(state)


def distributed_callbacks(flatten_images=False, ddp=False, broadcast='broadcast', uneven='min', **all_reduce):
    """The standard set of callbacks that makes a Trial data-parallel, in working order.

    Put them after your own callbacks, so that a stop requested by one of yours reaches every rank
    at the same step.

    Example: ::

        >>> from torchbearer import Trial
        >>> import torchbearer_dist as tbd
        >>> trial = Trial(model, optimizer, loss, metrics=['loss', 'acc'],
        ...               callbacks=[*tbd.distributed_callbacks(flatten_images=True)])

    Args:
        flatten_images (bool): add :class:`FlattenImages`
        ddp (bool): the model is DistributedDataParallel (see :func:`~torchbearer_dist.wrap_ddp`), which
            averages gradients itself: :class:`AgreeOnStop` replaces :class:`AllReduceGradients`
        broadcast (str): ``method`` of :class:`BroadcastParameters`
        uneven (str): ``policy`` of :class:`EvenBatches`
        **all_reduce: options of :class:`AllReduceGradients` (``bucket_cap_mb``, ``compression``, ...)

    Returns:
        list: BroadcastParameters, SetSamplerEpoch, EvenBatches, ReduceMetrics, RankZeroOutput,
        optionally FlattenImages, and AllReduceGradients (or AgreeOnStop) last
    """
    callbacks = [BroadcastParameters(method=broadcast), SetSamplerEpoch(), EvenBatches(policy=uneven),
                 ReduceMetrics(), RankZeroOutput()]
    if flatten_images:
        callbacks.append(FlattenImages())
    callbacks.append(AgreeOnStop() if ddp else AllReduceGradients(**all_reduce))
    return callbacks
