"""Distributed aggregators: torchbearer Metric nodes whose epoch figures cover every rank's samples.

torchbearer aggregates a metric in :class:`~torchbearer.bases.Metric` nodes of a tree (``Mean``,
``Std``, ``RunningMean``, ``EpochLambda`` under ``ToDict`` and ``MetricTree``) and offers no hook between
a metric's per-batch values and its epoch figure. Its Metric classes are its extension point: the nodes
of this module stand in for those aggregators (put there by
:func:`~torchbearer_dist.callbacks._metric_tree.globalize`), so the figures are global before any
printer, logger or checkpointer reads them. The nodes around metrics the package cannot inspect live in
:mod:`~torchbearer_dist.callbacks._custom_metrics`; how a metric says it combines over ranks is here
(:data:`REDUCTIONS`, :func:`mark`), with :class:`Pass`, what every node shares with its ReduceMetrics, the group
among them: every collective of a node goes through the group its ReduceMetrics was given (the default process
group unless told otherwise: a torchft quorum in the fault-tolerant mode), and where one of them was not whole
(torchft failed it) the node's figures are this process's own (:func:`reduced`), never partial sums.
"""
import copy
import inspect
import warnings
import weakref

import torch
from torchbearer.bases import Metric
from torchbearer.metrics import Std

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import gather
from torchbearer_dist.sync.group import SUM, WORLD

#: How a metric's values combine over ranks: a per-sample mean, a sum, a max, a min, or rank 0's own.
REDUCTIONS = ('mean', 'sum', 'max', 'min', 'rank0')
_MARK = '_torchbearer_dist_reduction'  # set on a Metric (instance or class) by reduce_metric


def check_reduction(reduction, where):
    """Raise a one-line ValueError unless ``reduction`` is one of :data:`REDUCTIONS`."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError('{} should be one of {}, but given {!r}'.format(
            where, ', '.join(repr(r) for r in REDUCTIONS), reduction))


def check_metric_reduction(metric_reduction):
    """Validate a ``metric_reduction`` argument (None, or metric names to :data:`REDUCTIONS`); return it as a dict."""
    if metric_reduction is None:
        return {}
    if not isinstance(metric_reduction, dict):
        raise ValueError('metric_reduction should be a dict of metric names to one of {}, but given {!r}'.format(
            ', '.join(repr(r) for r in REDUCTIONS), metric_reduction))
    for name, reduction in metric_reduction.items():
        if not isinstance(name, str):
            raise ValueError('metric_reduction should be keyed by metric names (str), but given {!r}'.format(name))
        check_reduction(reduction, 'metric_reduction[{!r}]'.format(name))
    return dict(metric_reduction)


def mark(metric, reduction):
    """Record on a Metric instance or class how its values combine over ranks (see ``reduce_metric``)."""
    if not (isinstance(metric, Metric) or inspect.isclass(metric) and issubclass(metric, Metric)):
        raise ValueError('reduce_metric decorates a torchbearer Metric (a class, or an instance such as '
                         '@lambda_metric gives), but given {!r}'.format(metric))
    setattr(metric, _MARK, reduction)
    return metric


def marked(metric):
    """The reduction :func:`mark` recorded on a Metric (instance or class), or None."""
    return getattr(metric, _MARK, None)


def _warn(message):
    """Warn every time it is called: Python's default filter would show a text once per line of code, but each
    Trial must hear it (ReduceMetrics says it once per Trial itself)."""
    line = inspect.currentframe().f_back.f_lineno
    warnings.warn_explicit(message, RuntimeWarning, __file__, line, module=__name__, registry={})


def check_group(group):
    """Validate a ReduceMetrics ``group`` argument: None, a group of :mod:`torchbearer_dist.sync.group`, or a
    function of no argument returning one (or None); return it."""
    if group is None or _is_group(group) or callable(group):
        return group
    raise ValueError('group should be None (the default process group), a group of torchbearer_dist.sync.group or a '
                     'function of no argument returning one (or None), but given {!r}'.format(group))


def _is_group(group):
    return all(callable(getattr(group, name, None)) for name in ('size', 'alone', 'rank', 'all_reduce', 'all_gather'))


class _Alone:
    """The group of a process that talks to nobody now (its group function returned None): one member, itself.

    Every node asks :meth:`alone` before a collective, so none is ever issued over it: the figures are its own.
    """

    def size(self):
        return 1

    def alone(self):
        return True

    def rank(self):
        return 0

    def device(self, like=None):
        return torch.device('cpu')


#: The group of one process, itself: see :class:`_Alone`.
ALONE = _Alone()


class NotWhole(Exception):
    """A collective of a node's reduction that the group could not complete (torchft failed it)."""


def reduced(compute, group):
    """``compute(group)``: a node's figures over ``group``; where one of its collectives was not whole, ``compute``
    again over this process alone (:data:`ALONE`): its own figures, never partial sums.

    A hierarchical group's ranks agree on whether a gather was whole, and a node's only sum is its last
    collective, so every rank of a replica group issues the same collectives whatever the outcome.
    """
    try:
        return compute(group)
    except (NotWhole, gather.IncompleteGather):
        return compute(ALONE)


class Pass:
    """What the distributed metric nodes share with their ReduceMetrics: the pass, the batch, what was said, and
    whom the figures are reduced over.

    Args:
        reductions (dict): ``metric_reduction``: metric names to :data:`REDUCTIONS`
        group: ReduceMetrics' ``group`` (see :func:`check_group`), read by :meth:`group` at each reduction
    """

    def __init__(self, reductions=None, group=None):
        self.training, self.batch, self.count, self.samples = True, 1, 1, 0
        self.reductions = dict(reductions or {})
        self.source = group
        self._said, self._trial = set(), None

    def group(self):
        """Whom the figures are reduced over now: the default process group (:data:`~torchbearer_dist.sync.group.
        WORLD`) unless given a group; a group function's answer, read now (None: :data:`ALONE`)."""
        source = self.source
        if source is None:
            return WORLD
        if _is_group(source):
            return source
        found = source()
        return ALONE if found is None else found

    def start(self, trial):
        """At a pass start: a Trial other than the last one hears every warning again."""
        if self._trial is None or self._trial() is not trial:
            self._said = set()
            self._trial = weakref.ref(trial) if trial is not None else None

    def __getstate__(self):  # a weak reference does not pickle: a copied Pass starts a Trial afresh
        return {**self.__dict__, '_said': set(), '_trial': None}

    def __deepcopy__(self, memo):  # the group (a live quorum, a replica's method) is shared, never copied
        copied = memo[id(self)] = Pass.__new__(Pass)
        state = self.__getstate__()
        source = state.pop('source')
        copied.__dict__.update(copy.deepcopy(state, memo), source=source)
        return copied

    def say(self, key, message):
        """On the group's rank 0, warn ``message`` once per Trial for ``key``."""
        if key not in self._said and self.group().rank() == 0:
            self._said.add(key)
            _warn(message)


def all_sum(values, group):
    """Sum float64 tensors over ``group`` in one all-reduce (shapes equal on every member).

    Raises:
        NotWhole: the group could not complete it
    """
    if group.alone() or not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values]).to(group.device())
    if not group.all_reduce(flat, SUM).wait():
        raise NotWhole()
    flat, out = flat.cpu(), []
    for v in values:
        out.append(flat[:v.numel()].reshape(v.shape))
        flat = flat[v.numel():]
    return out


def extremes(values, group):
    """The maximum and the minimum of each value (a float64 tensor) over ``group``, through its ``all_gather``: a
    torchft quorum sums only. Exact.

    Raises:
        NotWhole: the group could not complete it
    """
    if group.alone():
        return values, values
    every = torch.empty((group.size(),) + tuple(values.shape), dtype=values.dtype, device=group.device())
    if not group.all_gather(every, values.to(every.device)).wait():
        raise NotWhole()
    return every.amax(0).cpu(), every.amin(0).cpu()


def _as_tensor(value, numel, group):
    value = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    if not group.alone() and value.numel() == 1 and numel > 1:  # a rank without batches holds a 0.0
        value = value.reshape(-1).expand(numel).clone()
    return value


def _numel(value, group):
    """The largest numel of ``value`` over ``group``, so that every member sends tensors of one shape."""
    numel = torch.tensor([float(torch.as_tensor(value).numel())], dtype=torch.float64)
    return int(extremes(numel, group)[0].item())


def _result(tensor):
    return tensor.item() if tensor.numel() <= 1 else tensor.tolist()


class GlobalMean(Metric):
    """In place of torchbearer's ``Mean``: the per-sample mean over all ranks' samples.

    A 0-d value (a batch mean, such as the loss) counts once for each sample of its batch; a value
    with elements counts each element once, as torchbearer's Mean does (accuracy's per-sample hits).
    """

    def __init__(self, original, shared):
        super().__init__(original.name)
        self.original, self._dim, self._pass = original, _torchbearer.mean_dim(original), shared
        self.reset(None)

    def process(self, *args):
        if self._pass.batch == 0:
            return  # a batch of only a padding sampler's repeats, all dropped
        data = torch.as_tensor(args[0]).detach().to(torch.float64)
        weight = self._pass.batch if data.dim() == 0 else 1
        total = data.sum() if self._dim is None else data.sum(dim=self._dim)
        self._sum = self._sum + total.cpu() * weight
        self._count += weight * data.numel() // max(total.numel(), 1)

    def process_final(self, *args):
        return reduced(self._final, self._pass.group())

    def _final(self, group):
        numel = 1 if self._dim is None else _numel(self._sum, group)
        total, count = all_sum([_as_tensor(self._sum, numel, group), _as_tensor(float(self._count), 1, group)], group)
        return _result(total / count)

    def reset(self, state):
        self._sum, self._count = torch.zeros((), dtype=torch.float64), 0


class GlobalVar(Metric):
    """In place of torchbearer's ``Var`` and ``Std``: over the union of every rank's values."""

    def __init__(self, original, shared):
        super().__init__(original.name)
        self.original, self._pass = original, shared
        self._unbiased, self._dim = _torchbearer.var_unbiased(original), _torchbearer.mean_dim(original)
        self._std = type(original) is Std
        self.reset(None)

    def process(self, *args):
        if self._pass.batch == 0:
            return  # a batch of only a padding sampler's repeats, all dropped
        data = torch.as_tensor(args[0]).detach().to(torch.float64).cpu()
        kwargs = {} if self._dim is None else {'dim': self._dim}
        total = data.sum(**kwargs)
        self._sum, self._sum_sq = self._sum + total, self._sum_sq + data.pow(2).sum(**kwargs)
        self._count += data.numel() // max(total.numel(), 1)

    def process_final(self, *args):
        return reduced(self._final, self._pass.group())

    def _final(self, group):
        numel = 1 if self._dim is None else _numel(self._sum, group)
        total, squares, count = all_sum([_as_tensor(self._sum, numel, group), _as_tensor(self._sum_sq, numel, group),
                                         _as_tensor(float(self._count), 1, group)], group)
        variance = (squares / count - (total / count).pow(2)).clamp(min=0)
        if self._unbiased:
            variance = variance * (count / (count - 1.0))
        return _result(variance.sqrt() if self._std else variance)

    def reset(self, state):
        self._sum = self._sum_sq = torch.zeros((), dtype=torch.float64)
        self._count = 0


class Wrapped(Metric):
    def __init__(self, inner, shared):
        super().__init__(inner.name)
        self.inner, self._pass = inner, shared

    def process(self, *args):
        return self.inner.process(*args)

    def train(self):
        self.inner.train()

    def eval(self, data_key=None):
        self.inner.eval(data_key=data_key)

    def reset(self, state):
        self.inner.reset(state)


class RunningOverRanks(Wrapped):
    """Around a ``RunningMean``: at the end of training, the last running value averaged over ranks."""

    def process(self, *args):
        self._last = self.inner.process(*args)
        return self._last

    def process_final(self, *args):
        if not self._pass.training:
            return self.inner.process_final(*args)
        return reduced(self._final, self._pass.group())

    def _final(self, group):
        last = getattr(self, '_last', None)
        last = None if isinstance(last, dict) else last  # before its first step a RunningMean returns {}
        values = _as_tensor(0.0 if last is None else last, 1, group)
        numel = _numel(values, group)
        total, ranks = all_sum([_as_tensor(values, numel, group), _as_tensor(0.0 if last is None else 1.0, 1, group)],
                               group)
        return None if ranks.item() == 0 else _result(total / ranks)

    def reset(self, state):
        self._last = None
        self.inner.reset(state)


class GatheredEpochLambda(Wrapped):
    """Around an ``EpochLambda`` (roc_auc, ...): its function runs on the outputs of every rank, gathered."""

    def process_final(self, *args):
        group = self._pass.group()
        try:
            _torchbearer.gather_epoch_outputs(self.inner, lambda rows: gather.all_gather_rows(rows, group=group)[0])
        except gather.IncompleteGather:
            pass  # both left as they were: the function runs on this process's own outputs
        return self.inner.process_final(*args)
