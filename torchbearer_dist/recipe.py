"""The standard set of callbacks, in working order, for either mode: fail-fast or fault-tolerant.

:func:`distributed_callbacks` picks and orders the callbacks of :mod:`torchbearer_dist.callbacks` and, for
``fault_tolerant=``, :class:`~torchbearer_dist.FaultTolerantAllReduce` of :mod:`torchbearer_dist.ft`. It is a layer
above both: ``ft/`` builds on ``callbacks/``, and ``callbacks/`` never imports ``ft/``. torchft is an optional extra
that :mod:`torchbearer_dist.ft` imports only when a replica starts, so importing this module works without it.
"""
from torchbearer_dist.callbacks.broadcast import BroadcastParameters
from torchbearer_dist.callbacks.comm_report import CommunicationReport
from torchbearer_dist.callbacks.even_batches import EvenBatches
from torchbearer_dist.callbacks.gradients import AllReduceGradients
from torchbearer_dist.callbacks.images import FlattenImages
from torchbearer_dist.callbacks.low_communication import DiLoCo
from torchbearer_dist.callbacks.metrics import ReduceMetrics
from torchbearer_dist.callbacks.output import RankZeroOutput
from torchbearer_dist.callbacks.sampler import SetSamplerEpoch
from torchbearer_dist.callbacks.stop import AgreeOnStop
from torchbearer_dist.ft.callback import FaultTolerantAllReduce

__all__ = ['distributed_callbacks']


#: The options of :class:`~torchbearer_dist.FaultTolerantAllReduce` in ``distributed_callbacks(**options)``.
_FT_OPTIONS = ('replica_id', 'min_replicas', 'timeout', 'host', 'restarted')


def distributed_callbacks(flatten_images=False, ddp=False, broadcast='broadcast', uneven='min', gather_predictions=True,
                          loss_reduction='auto', check_data=True, check_order='raise', local_steps=None, report=True,
                          metric_reduction=None, fault_tolerant=None, **all_reduce):
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
            averages its gradients itself: :class:`AgreeOnStop` replaces :class:`AllReduceGradients`, and
            averages those of every other model the Trial holds (a GAN's discriminator)
        broadcast (str): ``method`` of :class:`BroadcastParameters`
        uneven (str): ``policy`` of :class:`EvenBatches`
        gather_predictions (bool): ``predict()`` returns the whole dataset's predictions on every rank
            (:class:`ReduceMetrics`); False keeps each rank's own shard
        loss_reduction (str): how the loss combines its samples: ``'auto'`` (a torch loss module with
            ``reduction='sum'`` is a sum, any other loss a mean), ``'mean'`` or ``'sum'`` (say so for a
            loss function that sums over the batch): gradients and loss figures are combined alike
        check_data (bool): the data sentinel of :class:`SetSamplerEpoch` (every rank given the same data)
        check_order (str or bool): the order sentinel of :class:`SetSamplerEpoch`: a shuffling training
            loader that repeats the previous epoch's order stops every rank (``'raise'``), warns on rank 0
            (``'warn'``, where the repetition is intended) or is not checked (``False``)
        metric_reduction (dict): how metrics whose batch values are not per-sample means combine over
            ranks, by name: ``{'running_peak': 'max'}`` (``'mean'``, ``'sum'``, ``'max'``, ``'min'``,
            ``'rank0'``; see :class:`ReduceMetrics` and :func:`~torchbearer_dist.reduce_metric`)
        report (bool): add :class:`CommunicationReport`: each epoch, rank 0 prints where the training
            time went (bytes sent, waits on communication, link rate, slowest rank) and the history
            holds the figures; ``False`` leaves it out
        local_steps (int): train ``local_steps`` steps locally between two averagings, with :class:`DiLoCo`
            in place of :class:`AllReduceGradients` (for slow links); ``**all_reduce`` then holds
            DiLoCo's options (``outer_lr``, ``outer_momentum``, ``compression``, ...); None (the default)
            averages gradients at every step
        fault_tolerant (str or bool): the fault-tolerant mode, on torchft (``pip install "torchbearer_dist[ft]"``):
            the lighthouse's ``'HOST:PORT'`` (True: ``$TORCHFT_LIGHTHOUSE``). Each process is then a replica
            that trains on among the live ones when others are lost and heals live when it (re)starts
            (:class:`~torchbearer_dist.FaultTolerantAllReduce`, which ``**all_reduce`` configures:
            ``replica_id``, ``min_replicas``, ``timeout``, ``host``, ``restarted``); the list is then SetSamplerEpoch,
            optionally FlattenImages, FaultTolerantAllReduce and a ReduceMetrics over its live replicas. With
            ``local_steps``, DiLoCo follows them and its meetings go through torchft, blocking and in fp32
            (``compression`` or ``overlap_steps`` raise ValueError; see :doc:`/fault_tolerance`). None (the
            default): the fail-fast mode
        **all_reduce: options of :class:`AllReduceGradients` (``bucket_cap_mb``, ``compression``,
            ``check_divergence``, ...)

    Returns:
        list: BroadcastParameters, SetSamplerEpoch, EvenBatches, ReduceMetrics, RankZeroOutput,
        CommunicationReport (unless ``report=False``), optionally FlattenImages, and AllReduceGradients
        (or AgreeOnStop; or DiLoCo with ``local_steps``) last
    """
    if fault_tolerant is not None and fault_tolerant is not False:
        return _fault_tolerant(fault_tolerant, flatten_images, ddp, local_steps, check_order, loss_reduction,
                               dict(gather_predictions=gather_predictions, metric_reduction=metric_reduction),
                               all_reduce)
    callbacks = [BroadcastParameters(method=broadcast), SetSamplerEpoch(check_data=check_data, check_order=check_order),
                 EvenBatches(policy=uneven),
                 ReduceMetrics(gather_predictions=gather_predictions, loss_reduction=loss_reduction,
                               metric_reduction=metric_reduction), RankZeroOutput()]
    if report:
        callbacks.append(CommunicationReport())
    if flatten_images:
        callbacks.append(FlattenImages())
    if local_steps is not None:
        if ddp:
            raise ValueError('local_steps={!r} does not combine with ddp=True: DistributedDataParallel averages '
                             'gradients at every step; pass one of them'.format(local_steps))
        callbacks.append(DiLoCo(local_steps=local_steps, **all_reduce))
        return callbacks
    callbacks.append(AgreeOnStop() if ddp else AllReduceGradients(loss_reduction=loss_reduction, **all_reduce))
    return callbacks


def _fault_tolerant(lighthouse, flatten_images, ddp, local_steps, check_order, loss_reduction, metrics, options):
    """The fault-tolerant set: each process a torchft replica (the mode lives in :mod:`torchbearer_dist.ft`), its
    figures and predictions reduced by :class:`ReduceMetrics` (``metrics``: its options) over the replica's group."""
    if ddp not in (None, False):
        raise ValueError('ddp={!r} does not combine with fault_tolerant yet: the fault-tolerant mode averages '
                         'gradients through torchft; pass one of them'.format(ddp))
    diloco = {k: options.pop(k) for k in sorted(options) if k not in _FT_OPTIONS} if local_steps is not None else {}
    if diloco.get('compression') is not None or diloco.get('overlap_steps'):
        raise ValueError('fault_tolerant meetings block and travel in fp32: leave out compression and overlap_steps '
                         '(or pass None and 0), not compression={!r}, overlap_steps={!r}'.format(
                             diloco.get('compression'), diloco.get('overlap_steps')))
    callbacks = [SetSamplerEpoch(check_data=False, check_order=check_order)]
    if flatten_images:
        callbacks.append(FlattenImages())
    replica = FaultTolerantAllReduce(lighthouse, loss_reduction=loss_reduction, every_step=local_steps is None,
                                     **options)
    # the live replicas at each reduction (None: nobody, outside a run or in one that ends to begin again)
    callbacks += [replica, ReduceMetrics(loss_reduction=loss_reduction, group=replica.group, **metrics)]
    if local_steps is not None:
        diloco.update(compression=None, overlap_steps=0)
        callbacks.append(DiLoCo(local_steps=local_steps, meetings=replica, **diloco))
    return callbacks
