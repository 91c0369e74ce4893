"""The synchronizing callbacks: thin torchbearer :class:`~torchbearer.callbacks.Callback` classes over :mod:`.comm`.

Each works with no arguments once the process group is up, and does nothing in a job of one
process, so the same Trial runs unchanged with and without distribution.
"""
import weakref

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist import comm
from torchbearer_dist.consistency import EvenBatches
from torchbearer_dist.data import SetSamplerEpoch
from torchbearer_dist.gradients import SKIPPED_STEPS, AllReduceGradients  # noqa: F401 (re-exported)
from torchbearer_dist.metrics import ReduceMetrics
from torchbearer_dist.output import RankZeroOutput
from torchbearer_dist.stop import AgreeOnStop


class BroadcastParameters(Callback):
    """Copy rank 0's parameters and buffers to every rank before the first epoch of a Trial.

    It acts at the start of the first epoch that a Trial runs, evaluates or predicts, after every
    callback's ``on_init`` and ``on_start`` (weight initialisation, a loaded checkpoint), and also when
    the process group came up after the Trial was built. It first checks, with one small exchange
    of a fingerprint, that every rank holds the same parameter and buffer names, shapes and dtypes;
    on a mismatch every rank raises, naming the first entry that differs. Values are copied, never
    averaged. A new Trial, or a new model in the Trial, is broadcast again.

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
        - :attr:`torchbearer.state.MODEL`: the model to synchronize
        - :attr:`torchbearer.state.SELF`: the Trial, to broadcast once per Trial and model

    .. warning:: A synchronization point: every rank must run its Trial.
    """

    def __init__(self, method='broadcast', src=0):
        super().__init__()
        if method not in ('broadcast', 'p2p'):
            raise ValueError("method should be 'broadcast' or 'p2p', but given {!r}".format(method))
        self.method = method
        self.src = src
        self._done = None  # weak references to the Trial and model last broadcast

    def on_start_epoch(self, state):
        model = state[torchbearer.MODEL]
        if not isinstance(model, torch.nn.Module) or comm.world_size() == 1:
            return
        trial = state.get(torchbearer.SELF)
        if self._done is not None and self._done[0]() is trial and self._done[1]() is model:
            return
        comm.check_same_model(model, self.src)
        comm.broadcast_state(model, self.src, self.method)
        self._done = (weakref.ref(trial) if trial is not None else lambda: None, weakref.ref(model))


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


def distributed_callbacks(flatten_images=False, ddp=False, broadcast='broadcast', uneven='min', gather_predictions=True,
                          **all_reduce):
    """The standard set of callbacks that makes a Trial data-parallel, in working order.

    They work wherever they sit in the Trial's callback list, before or after your own callbacks:
    gradients are averaged before any ``on_backward`` callback runs, and rank 0's weights are copied
    after every callback's initialisation.

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
        gather_predictions (bool): ``predict()`` returns the whole dataset's predictions on every rank
            (:class:`ReduceMetrics`); False keeps each rank's own shard
        **all_reduce: options of :class:`AllReduceGradients` (``bucket_cap_mb``, ``compression``, ...)

    Returns:
        list: BroadcastParameters, SetSamplerEpoch, EvenBatches, ReduceMetrics, RankZeroOutput,
        optionally FlattenImages, and AllReduceGradients (or AgreeOnStop) last
    """
    callbacks = [BroadcastParameters(method=broadcast), SetSamplerEpoch(), EvenBatches(policy=uneven),
                 ReduceMetrics(gather_predictions=gather_predictions), RankZeroOutput()]
    if flatten_images:
        callbacks.append(FlattenImages())
    callbacks.append(AgreeOnStop() if ddp else AllReduceGradients(**all_reduce))
    return callbacks
