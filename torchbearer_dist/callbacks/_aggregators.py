"""Distributed aggregators: torchbearer Metric nodes whose epoch figures cover every rank's samples.

torchbearer aggregates a metric in :class:`~torchbearer.bases.Metric` nodes of a tree (``Mean``,
``Std``, ``RunningMean``, ``EpochLambda`` under ``ToDict`` and ``MetricTree``) and offers no hook between
a metric's per-batch values and its epoch figure. Its Metric classes are its extension point: the nodes
of this module stand in for those aggregators (put there by
:func:`~torchbearer_dist.callbacks._metric_tree.globalize`), so the figures are global before any
printer, logger or checkpointer reads them. The nodes around metrics the package cannot inspect live in
:mod:`~torchbearer_dist.callbacks._custom_metrics`; how a metric says it combines over ranks is here
(:data:`REDUCTIONS`, :func:`mark`), with :class:`Pass`, what every node shares with its ReduceMetrics.
"""
import inspect
import warnings
import weakref

import torch
import torch.distributed as dist
from torchbearer.bases import Metric
from torchbearer.metrics import Std

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import collectives, gather

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


class Pass:
    """What the distributed metric nodes share with their ReduceMetrics: the pass, the batch, what was said.

    Args:
        reductions (dict): ``metric_reduction``: metric names to :data:`REDUCTIONS`
    """

    def __init__(self, reductions=None):
        self.training, self.batch, self.count, self.samples = True, 1, 1, 0
        self.reductions = dict(reductions or {})
        self._said, self._trial = set(), None

    def start(self, trial):
        """At a pass start: a Trial other than the last one hears every warning again."""
        if self._trial is None or self._trial() is not trial:
            self._said = set()
            self._trial = weakref.ref(trial) if trial is not None else None

    def __getstate__(self):  # a weak reference does not pickle: a copied Pass starts a Trial afresh
        return {**self.__dict__, '_said': set(), '_trial': None}

    def say(self, key, message):
        """On rank 0, warn ``message`` once per Trial for ``key``."""
        if collectives.rank() == 0 and key not in self._said:
            self._said.add(key)
            _warn(message)


def _all_sum(values):
    """Sum float64 tensors over ranks in one all-reduce (shapes equal on every rank)."""
    if collectives.world_size() == 1 or not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values]).to(collectives.comm_device(torch.device('cpu')))
    dist.all_reduce(flat)
    flat, out = flat.cpu(), []
    for v in values:
        out.append(flat[:v.numel()].reshape(v.shape))
        flat = flat[v.numel():]
    return out


def _as_tensor(value, numel):
    value = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    if collectives.world_size() > 1 and value.numel() == 1 and numel > 1:  # a rank without batches holds a 0.0
        value = value.reshape(-1).expand(numel).clone()
    return value


def _numel(value):
    """The largest numel of ``value`` over ranks, so that every rank sends tensors of one shape."""
    return collectives.reduce_int(torch.as_tensor(value).numel(), 'max')


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
        numel = 1 if self._dim is None else _numel(self._sum)
        total, count = _all_sum([_as_tensor(self._sum, numel), _as_tensor(float(self._count), 1)])
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
        numel = 1 if self._dim is None else _numel(self._sum)
        total, squares, count = _all_sum([_as_tensor(self._sum, numel), _as_tensor(self._sum_sq, numel),
                                          _as_tensor(float(self._count), 1)])
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
        last = getattr(self, '_last', None)
        last = None if isinstance(last, dict) else last  # before its first step a RunningMean returns {}
        values = _as_tensor(0.0 if last is None else last, 1)
        numel = _numel(values)
        total, ranks = _all_sum([_as_tensor(values, numel), _as_tensor(0.0 if last is None else 1.0, 1)])
        return None if ranks.item() == 0 else _result(total / ranks)

    def reset(self, state):
        self._last = None
        self.inner.reset(state)


class GatheredEpochLambda(Wrapped):
    """Around an ``EpochLambda`` (roc_auc, ...): its function runs on the outputs of every rank, gathered."""

    def process_final(self, *args):
        _torchbearer.gather_epoch_outputs(self.inner, lambda rows: gather.all_gather_rows(rows)[0])
        return self.inner.process_final(*args)
