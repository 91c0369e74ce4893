"""Global epoch metrics and predictions: every rank reports the figures of the union of all ranks' samples.

The aggregation itself lives in the metric nodes that :mod:`torchbearer_dist.callbacks._metric_tree` places in
the Trial's metric tree; this module holds the callback that installs them, counts samples, drops a padding
sampler's repeats (:mod:`torchbearer_dist.callbacks._batches`) and gathers predictions. Every collective of
both goes through one group of :mod:`torchbearer_dist.sync.group`: the default process group (the fail-fast
mode), or the one it is given (the live replicas of a torchft quorum in the fault-tolerant mode).
"""
import time

import torch
import torch.distributed as dist
import torchbearer
from torch.utils.data import DistributedSampler
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.callbacks import _aggregators, _metric_tree
from torchbearer_dist.callbacks._batches import batch_size, padding_sampler, trim
from torchbearer_dist.callbacks._loss_reduction import check_loss_reduction, loss_is_summed
from torchbearer_dist.runtime.env import current_env
from torchbearer_dist.sync import gather
from torchbearer_dist.sync.group import DistGroup


def reduce_metric(reduction):
    """Say how a metric's values combine over ranks, where the metric is defined: a decorator.

    Stack it with torchbearer's metric decorators, over the function or class whose batch value
    your ``@mean``, ``@running_mean`` or ``@std`` aggregate: every figure of the metric (``peak``,
    ``running_peak``, ``peak_std``) is then computed from the combined batch values, as one process
    at N x B computes it. Over a Metric class that is not such a tree (an F1 that counts over the
    epoch), it says how its epoch figures combine. ``ReduceMetrics(metric_reduction=...)`` says the
    same where the metric is used, and takes precedence.

    Example: ::

        >>> import torchbearer_dist as tbd
        >>> from torchbearer import metrics
        >>> @metrics.running_mean
        ... @metrics.mean
        ... @tbd.reduce_metric('max')
        ... @metrics.lambda_metric('peak')
        ... def peak(y_pred, y_true):  # each batch's maximum confidence
        ...     return y_pred.softmax(1).max()

    Args:
        reduction (str): ``'mean'`` (a per-sample mean: the union's value weighs each rank's by its
            samples), ``'sum'``, ``'max'``, ``'min'``, or ``'rank0'`` (rank 0's own value on every rank)

    Returns:
        A decorator that marks a torchbearer Metric (class or instance) and returns it unchanged

    Raises:
        ValueError: ``reduction`` is none of these (when ``reduce_metric`` is called), or what it
            decorates is not a torchbearer Metric
    """
    _aggregators.check_reduction(reduction, 'reduce_metric\'s reduction')
    return lambda metric: _aggregators.mark(metric, reduction)


class _ScaleSummedLoss(Callback):
    """Runs after every other callback (appended for a pass): a summed loss, times N, as one process at N x B sums."""

    def __init__(self, shared):
        super().__init__()
        self.shared, self._last = shared, None

    def _scale(self, state):
        loss = state.get(torchbearer.LOSS)
        if isinstance(loss, torch.Tensor) and loss is not self._last:  # scaled once, however many hooks run
            factor = float(self.shared.group().size())  # N at this step (a torchft quorum's may change)
            self._last = state[torchbearer.LOSS] = loss.detach() * factor

    on_backward = on_criterion_validation = _scale

    def __str__(self):
        return 'summed loss of ReduceMetrics'


class ReduceMetrics(Callback):
    """Report epoch metrics over the union of all ranks' samples, identical on every rank, and gather predictions.

    What each figure is, with N ranks at batch B:

    - **Loss and every averaging metric** (torchbearer's ``Mean``: loss, acc, mse, any ``@mean``
      metric): the per-sample mean over the union of all ranks' samples. A batch-mean value such as
      the loss counts once for each sample of its batch, so a ragged last batch weighs what it holds.
      This is what one process at N x B reports whenever its batches are all full; torchbearer alone
      averages batch means with equal weights, which differs from the per-sample mean only when the
      batches differ in size. The same definition holds in a job of one process, so a Trial reports
      the same figures on one rank and on N.
    - ``Std`` / ``Var``: over the union of every rank's values.
    - **Metrics that are not means** (torchbearer's ``EpochLambda``, such as roc_auc): computed on the
      outputs of all ranks, gathered, never averaged.
    - ``running_`` figures: the last running value of each rank, averaged over ranks.
    - **A function the package cannot inspect** (``@mean``, ``@running_mean``, ``@std`` over your own
      ``@lambda_metric`` or Metric class): its batch values are averaged as above, which is right
      when each is a per-sample mean (or one value per sample). Where a batch value is something
      else, such as the batch's maximum confidence, say how it combines in one place, for every
      figure of the metric at once: ``metric_reduction={'peak': 'max'}`` here (or in
      :func:`~torchbearer_dist.distributed_callbacks`), or :func:`reduce_metric` where the metric is
      defined. ``'sum'``, ``'max'``, ``'min'`` and ``'rank0'`` combine each batch's value over ranks
      (the i-th batch of one process at N x B holds every rank's i-th batch) and the metric's
      aggregators run on the combined values: the epoch and running figures equal one process at
      N x B. Until it is said, rank 0 warns once per Trial (``RuntimeWarning``) naming the metric and
      the assumption; torchbearer's own metrics (loss, accuracies, mse) are known and silent.
    - Any other metric (an F1 or a max as a ``Metric`` class): left as torchbearer computes it on
      each rank, never averaged; where its figure differs between ranks, rank 0 warns once per Trial
      that it covers rank 0's samples only (compute it in an ``EpochLambda`` to cover every rank's).
      Declared, its epoch figures are combined: summed, the max, the min, the mean weighted by each
      rank's samples, or rank 0's on every rank (``'rank0'``). Figures the same on every rank (epoch,
      lr) pass silently.

    With a **summed loss** (a torch loss module with ``reduction='sum'``, or ``loss_reduction='sum'``),
    one process at N x B reports the sum over N x B samples: every rank's batch loss then counts
    once per batch, times N, and the loss, ``running_loss`` and ``val_loss`` equal the figures of
    one process at N x B (``state[torchbearer.LOSS]`` holds that value after backward).

    Under a padding DistributedSampler, validation and prediction drop the repeated samples, so each
    sample counts exactly once. The sampler is found inside a wrapper loader too; with several
    samplers (a loader that zips loaders) the padding cannot be told apart, and rank 0 warns.
    ``Trial.predict()`` on a loader with a DistributedSampler returns, on
    every rank, the predictions of the whole dataset in dataset order (each sample once), as one
    process would. ``evaluate()`` and ``predict()`` are collectives: each first checks that every
    rank has joined, and a rank calling one alone raises instead of waiting in a reduction.

    Example: ::

        >>> from torchbearer_dist import ReduceMetrics
        >>> model = torch.nn.Linear(2, 1)
        >>> trial = Trial(model, metrics=['loss'], callbacks=[ReduceMetrics()])

    Args:
        gather_predictions (bool): ``False`` makes ``predict()`` return only this rank's own predictions
        loss_reduction (str): ``'auto'`` (a torch loss module with ``reduction='sum'`` is a sum, any other
            loss a mean), ``'mean'`` or ``'sum'``
        metric_reduction (dict): how metrics combine over ranks, by name (the metric's name or any of
            its figures, such as ``'running_peak'``): ``'mean'``, ``'sum'``, ``'max'``, ``'min'`` or
            ``'rank0'`` (rank 0's own); it takes precedence over :func:`reduce_metric`
        group: whom the figures are reduced over, and the predictions gathered from: None, the default process
            group (the fail-fast mode); a group of :mod:`torchbearer_dist.sync.group` (a
            :class:`~torchbearer_dist.sync.group.QuorumGroup` of torchft's live replicas, a
            :class:`~torchbearer_dist.sync.group.HierarchicalGroup`); or a function of no argument returning one,
            read at each reduction, or None where this process talks to nobody then (its figures stay its own). Every
            collective goes through it, and ``N`` is its ``size()`` (the rank count of the text above, a summed
            loss's factor, read at each step); where one of a figure's collectives was not whole (torchft failed it)
            that figure is this process's own, never a partial sum. The check that every rank joined
            ``evaluate()`` and ``predict()`` is the process group's (a ``DistGroup``)

    Raises:
        ValueError: an argument is not one of the values above (at construction); ``metric_reduction``
            names no metric of the Trial, or gives one metric two reductions (at the first pass, on
            every rank)
        ~torchbearer_dist.sync.gather.IncompleteGather: a RuntimeError from ``predict()`` where torchft failed
            its gather (a fault-tolerant group only): never the predictions of some replicas as if of all

    State Requirements:
        - :attr:`torchbearer.state.METRIC_LIST`: its aggregators are replaced at each pass start
        - :attr:`torchbearer.state.X`, :attr:`torchbearer.state.Y_TRUE`: counted per batch
        - :attr:`torchbearer.state.FINAL_PREDICTIONS`: gathered at the end of ``predict()``

    .. warning:: A synchronization point at the end of each training and validation pass, and at the
        start of ``evaluate()`` and ``predict()``: every rank must call them.
    """

    def __init__(self, gather_predictions=True, loss_reduction='auto', metric_reduction=None, group=None):
        super().__init__()
        if not isinstance(gather_predictions, bool):
            raise ValueError('gather_predictions should be True or False, but given {!r}'.format(gather_predictions))
        check_loss_reduction(loss_reduction)
        self.gather_predictions = gather_predictions
        self.loss_reduction = loss_reduction
        self.metric_reduction = _aggregators.check_metric_reduction(metric_reduction)
        self._pass = _aggregators.Pass(self.metric_reduction, _aggregators.check_group(group))
        self._remaining = self._sampler = None
        self._trained = self._predicting = self._summed = False
        self._scaler, self._scaling = None, None

    @property
    def group(self):
        """The ``group`` given: None, a group, or a function returning one (shared by a copy, never copied)."""
        return self._pass.source

    def on_start(self, state):
        self._trained = False
        # a group given may hold others at any step: its N is read at each one
        many = self.group is not None or not self._pass.group().alone()
        self._summed = many and loss_is_summed(state, self.loss_reduction)

    def _start_pass(self, state, training):
        self._pass.training, self._pass.samples = training, 0
        self._pass.start(state.get(torchbearer.SELF))
        _metric_tree.globalize(state[torchbearer.METRIC_LIST], self._pass)
        self._stop_scaling()
        if self._summed:  # appended for the pass, after every callback (an @add_to_loss term included)
            self._scaler = self._scaler or _ScaleSummedLoss(self._pass)
            callbacks = _torchbearer.callback_list(state[torchbearer.CALLBACK_LIST])
            while self._scaler in callbacks:
                callbacks.remove(self._scaler)
            callbacks.append(self._scaler)
            self._scaling = callbacks  # released at the pass end (or the next pass start, after a raise)

    def _stop_scaling(self):
        callbacks = self._scaling
        if callbacks is not None and self._scaler in callbacks:
            callbacks.remove(self._scaler)
        self._scaling = None

    def _weight(self, n):
        """The weight of a batch value: its samples, or one per batch for a summed loss."""
        return min(n, 1) if self._summed else n

    def on_start_training(self, state):
        self._trained = True
        self._start_pass(state, True)

    def on_sample(self, state):
        n = batch_size(state)
        self._pass.batch, self._pass.count = self._weight(n), n
        self._pass.samples += n

    def on_end_training(self, state):
        self._stop_scaling()

    def on_end(self, state):
        self._stop_scaling()

    def on_start_validation(self, state):
        self._predicting = _torchbearer.predicting(state[torchbearer.CALLBACK_LIST])
        group = self._pass.group()
        if not self._trained and isinstance(group, DistGroup) and not group.alone():
            _check_in('predict' if self._predicting else 'evaluate', group)
        self._start_pass(state, False)
        self._remaining = None
        self._sampler = padding_sampler(state.get(torchbearer.GENERATOR), group.rank())
        if isinstance(self._sampler, DistributedSampler) and not self._sampler.drop_last:
            total = len(self._sampler.dataset)
            self._remaining = len(range(self._sampler.rank, total, self._sampler.num_replicas))

    def on_sample_validation(self, state):
        n = batch_size(state)
        if self._remaining is not None:
            keep = min(n, self._remaining)
            self._remaining -= keep
            if keep < n:
                for key in (torchbearer.X, torchbearer.Y_TRUE):
                    if key in state:
                        state[key] = trim(state[key], keep)
                n = keep
        self._pass.batch, self._pass.count = self._weight(n), n
        self._pass.samples += n

    def on_end_validation(self, state):
        self._stop_scaling()
        if not (self._predicting and self.gather_predictions and isinstance(self._sampler, DistributedSampler)):
            return
        group = self._pass.group()
        if group.alone():
            return
        predictions = state.get(torchbearer.FINAL_PREDICTIONS)
        if isinstance(predictions, list) and not predictions:
            predictions = None  # no batch on this rank
        if predictions is not None and not isinstance(predictions, torch.Tensor):
            raise ValueError('predict() can gather only tensor predictions, but the model returned {}; return one '
                             'tensor, or pass ReduceMetrics(gather_predictions=False)'.format(type(predictions[0])))
        state[torchbearer.FINAL_PREDICTIONS] = gather.gather_predictions(predictions, list(self._sampler), group=group)


def _check_in(what, group):
    """Before the first collective of ``evaluate()`` or ``predict()``: fail clearly if a rank of ``group`` (a
    :class:`~torchbearer_dist.sync.group.DistGroup`) is missing.

    Waits at most the rendezvous timeout of the job (its ``meet_timeout`` where the job has one, else its
    ``timeout``; torch's default for a group started without torchbearer_dist).
    """
    if dist.get_backend(group.process_group) != 'gloo':
        return  # monitored_barrier is gloo's: under nccl a missing rank shows as the collective timeout
    env = current_env()
    timeout = None if env is None else getattr(env, 'meet_timeout', env.timeout)
    started = time.monotonic()
    try:
        dist.monitored_barrier(group=group.process_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        if timeout is not None and time.monotonic() - started < timeout.total_seconds() / 2:
            # it did not wait for a missing rank: the group failed under it (a peer's error, the heartbeat's
            # verdict), and the group's own handler names that cause
            raise
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError('{}() is a collective that every rank must call, but not every rank joined rank {} within '
                           '{} s ({}); call {}() on every rank'.format(what, group.rank(), _seconds(timeout),
                                                                      detail, what)) from None


def _seconds(timeout):
    return 'the default timeout' if timeout is None else '{:g}'.format(timeout.total_seconds())
