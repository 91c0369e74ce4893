"""Distributed aggregators: torchbearer Metric nodes whose epoch figures cover every rank's samples.

torchbearer aggregates a metric in :class:`~torchbearer.bases.Metric` nodes of a tree (``Mean``,
``Std``, ``RunningMean``, ``EpochLambda`` under ``ToDict`` and ``MetricTree``) and offers no hook between
a metric's per-batch values and its epoch figure. Its Metric classes are its extension point, so
:func:`globalize` puts the nodes of this module in place of those aggregators in a Trial's metric tree:
the one place that rewrites torchbearer objects. The figures are then global before any printer,
logger or checkpointer reads them.

A metric tree (``@mean``, ``@running_mean``, ``@std`` over a function) feeds one batch value to
its aggregators. Where the package knows what that value is (torchbearer's own loss, accuracies,
mse), or the user said how it combines over ranks (:data:`REDUCTIONS`), the figures are exact;
otherwise it is averaged as a per-sample mean and rank 0 says so once per Trial.
"""
import copy
import inspect
import warnings
import weakref

import torch
import torch.distributed as dist
from torchbearer.bases import Metric
from torchbearer.metrics import BatchLambda, EpochLambda, Mean, MetricTree, RunningMean, Std, Var

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


class _GlobalMean(Metric):
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


class _GlobalVar(Metric):
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


class _Wrapped(Metric):
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


class _RunningOverRanks(_Wrapped):
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


class _GatheredEpochLambda(_Wrapped):
    """Around an ``EpochLambda`` (roc_auc, ...): its function runs on the outputs of every rank, gathered."""

    def process_final(self, *args):
        _torchbearer.gather_epoch_outputs(self.inner, lambda rows: gather.all_gather_rows(rows)[0])
        return self.inner.process_final(*args)


def _numbers(result, name):
    """The numeric figures of a metric's epoch result, by name, in a fixed order: (dict, names)."""
    numbers = result if isinstance(result, dict) else {name: result}
    names = sorted(k for k, v in numbers.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   or isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point())
    return numbers, names


def _put(result, numbers, names, values):
    """``result`` with the figures ``names`` replaced by ``values``."""
    if not isinstance(result, dict):
        return values[0] if names else result
    return {**numbers, **dict(zip(names, values))}


class _SameOnEveryRank(_Wrapped):
    """Around any other metric (a max, an F1, a custom Metric): left as torchbearer computes it on each rank.

    This module cannot know how such a figure combines over ranks, so it never averages it. When its
    numeric epoch figures differ between ranks, rank 0 warns once per Trial that they are this rank's
    own; figures that agree on every rank (epoch, lr, ...) pass silently.
    """

    def process_final(self, *args):
        result = self.inner.process_final(*args)
        if collectives.world_size() == 1:
            return result
        numbers, names = _numbers(result, '')
        local = torch.tensor([float(numbers[k]) for k in names], dtype=torch.float64)
        both = torch.cat([local, -local]).to(collectives.comm_device(torch.device('cpu')))
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # a synchronization point for every rank alike
        high, low = both[:len(names)].cpu(), -both[len(names):].cpu()
        differ = [k or self.name for k, h, lo in zip(names, high.tolist(), low.tolist()) if h != lo]
        if differ:
            self._pass.say(('unknown', self.name), UNKNOWN.format(
                ', '.join(repr(k) for k in differ), type(self.inner).__name__, self.name))
        return result


class _CombinedFigures(_Wrapped):
    """Around a metric that is not a tree of aggregators, declared: its epoch figures combined over ranks.

    ``'sum'``, ``'max'`` and ``'min'`` reduce each numeric figure over ranks; ``'mean'`` weighs each
    rank's figure by the samples it saw in the pass; ``'rank0'`` gives every rank rank 0's figure.
    """

    def __init__(self, inner, shared, reduction):
        super().__init__(inner, shared)
        self._reduction = reduction

    def process_final(self, *args):
        result = self.inner.process_final(*args)
        if collectives.world_size() == 1:
            return result
        numbers, names = _numbers(result, self.name)
        local = torch.tensor([float(numbers[k]) for k in names] + [0.0], dtype=torch.float64)
        op = dist.ReduceOp.SUM
        if self._reduction in ('max', 'min'):
            op = dist.ReduceOp.MAX if self._reduction == 'max' else dist.ReduceOp.MIN
        elif self._reduction == 'mean':
            local = torch.cat([local[:-1] * self._pass.samples, local.new_tensor([self._pass.samples])])
        elif self._reduction == 'rank0' and collectives.rank() != 0:
            local.zero_()
        local = local.to(collectives.comm_device(torch.device('cpu')))
        dist.all_reduce(local, op=op)  # a synchronization point for every rank alike
        values = local.cpu()[:-1]
        if self._reduction == 'mean':
            values = values / local[-1].item() if local[-1].item() else values
        return _put(result, numbers, names, values.tolist())


class _Assumed(_Wrapped):
    """Around the root of a tree whose function the package cannot inspect, undeclared: averaged, and said.

    Its batch values are averaged over ranks as per-sample means by the tree's global aggregators.
    A value with one entry per sample of the batch is exactly that; a value of any other shape (a
    batch max, a sum) may not be, so rank 0 warns once per Trial naming the metric and the assumption.
    """

    def __init__(self, inner, shared, figures):
        super().__init__(inner, shared)
        self._figures, self._unsure = figures, False

    def process(self, *args):
        value = self.inner.process(*args)
        first = next(iter(value.values()), None) if isinstance(value, dict) else value
        per_sample = isinstance(first, torch.Tensor) and first.dim() > 0 and first.size(0) == self._pass.count
        self._unsure = self._unsure or not per_sample
        return value

    def process_final(self, *args):
        if self._unsure and collectives.world_size() > 1:
            self._pass.say(('assumed', self.name), ASSUMED.format(
                name=self.name, figures=', '.join(repr(f) for f in self._figures)))
        return self.inner.process_final(*args)

    def reset(self, state):
        self._unsure = False
        self.inner.reset(state)


def _first(value):
    """What a MetricTree passes to its children: a dict's first value, else the value itself."""
    return next(iter(value.values())) if isinstance(value, dict) and value else value


def _outputs(children, method, value):
    """Each child's ``method(value)``, merged, as a MetricTree merges its children's outputs."""
    result = {}
    for child in children:
        out = getattr(child, method)(value)
        if out is not None:
            result.update(out)
    return result


class _CombinedTree(_Wrapped):
    """Around a metric tree declared ``'sum'``, ``'max'``, ``'min'`` or ``'rank0'``: its batch values combined.

    During the pass the tree runs as torchbearer runs it, on this rank's batches (the progress bar
    shows this rank's running figures). At the pass end every rank's batch values are gathered,
    combined batch by batch (the i-th batch of one process at N x B is the union of every rank's
    i-th batch), and replayed through the tree's aggregators as they stood before the pass: the
    epoch figures, the running ones included, are those of one process at N x B.
    """

    def __init__(self, inner, shared, reduction):
        super().__init__(inner, shared)
        self._reduction = reduction
        self._begin()

    def _begin(self):
        self._batches, self._values, self._before, self._index = [], [], None, 0

    def reset(self, state):
        self.inner.reset(state)
        self._begin()

    def process(self, *args):
        index, self._index = self._index, self._index + 1
        if self._pass.batch == 0:
            return {}  # a batch of only a padding sampler's repeats, all dropped
        if self._before is None:  # the aggregators as the pass found them (a running mean's window included)
            self._before = copy.deepcopy(self.inner.children)
        value = _first(self.inner.root.process(*args))
        self._batches.append((index, self._pass.batch))
        self._values.append(value)
        return _outputs(self.inner.children, 'process', value)

    def process_final(self, *args):
        combined = self._combined()
        if self._before is not None:
            self.inner.children, self._before = self._before, None
        result = {}
        for value in combined:
            result = _outputs(self.inner.children, 'process', value)
        final = _first(self.inner.root.process_final(*args))
        result.update(_outputs(self.inner.children, 'process_final', final))
        return result

    def _combined(self):
        """The batch values of one process at N x B, in batch order (a synchronization point)."""
        values = [torch.as_tensor(v).detach().to(torch.float64).cpu() for v in self._values]
        shapes = sorted({tuple(v.shape) for v in values})
        rows = torch.tensor([[i, n, float(len(shapes) > 1)] for i, n in self._batches], dtype=torch.float64)
        rows, counts = gather.all_gather_rows(rows if len(rows) else None)
        if rows is not None and rows[:, 2].any():
            raise ValueError('metric {!r} is declared {!r}, which combines batch values of one shape, but its batch '
                             'values change shape between batches on some rank (this rank: {}); reduce each batch to '
                             'one shape, such as a scalar, or declare it \'mean\''.format(
                                 self.name, self._reduction, shapes))
        stacked, _ = gather.all_gather_rows(torch.stack(values) if values else None)
        if rows is None:
            return []
        ranks = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        keep = rows[:, 1] > 0
        if self._reduction == 'rank0':
            keep &= ranks == 0
        combined = []
        for index in torch.unique(rows[keep, 0]).tolist():
            chosen = stacked[keep & (rows[:, 0] == index)]
            if self._reduction == 'sum':
                combined.append(chosen.sum(0))
            elif self._reduction == 'max':
                combined.append(chosen.amax(0))
            elif self._reduction == 'min':
                combined.append(chosen.amin(0))
            else:
                combined.append(chosen[0])
        return combined


UNKNOWN = ('torchbearer_dist: metric {0} ({1}) is not one ReduceMetrics knows how to combine over ranks (Mean, '
           'Var, Std, RunningMean, EpochLambda); it differs between ranks and is left as torchbearer computes it '
           'on each rank, over that rank\'s samples only: what rank 0 prints, logs and checkpoints on is rank 0\'s; '
           'compute it in an EpochLambda (it then sees every rank\'s outputs), or say how its figures combine with '
           'metric_reduction={{{2!r}: \'max\'}} (or \'sum\', \'min\', \'mean\', \'rank0\') or '
           '@torchbearer_dist.reduce_metric')

ASSUMED = ('torchbearer_dist: metric {name!r} ({figures}) comes from a function ReduceMetrics cannot inspect, so '
           'each batch\'s value is assumed to be a mean over the batch\'s samples and averaged over ranks; if it is a '
           'sum, a max, a min or rank 0\'s own, say so with metric_reduction={{{name!r}: \'max\'}} (an argument of '
           'distributed_callbacks() and ReduceMetrics) or @torchbearer_dist.reduce_metric(\'max\'), or \'mean\' to '
           'confirm it')

_AGGREGATORS = (Mean, Var, Std, RunningMean)


def _restore(node):
    """The torchbearer node a distributed one stands for, its containers restored too (in place)."""
    while isinstance(node, (_Wrapped, _GlobalMean, _GlobalVar)):
        node = node.inner if isinstance(node, _Wrapped) else node.original
    if isinstance(node, MetricTree):
        node.root = _restore(node.root)
        node.children = [_restore(child) for child in node.children]
        return node
    for attribute in ('metric', 'metric_list'):
        inner = getattr(node, attribute, None)
        if isinstance(inner, Metric):
            setattr(node, attribute, _restore(inner))
        elif isinstance(inner, list):
            setattr(node, attribute, [_restore(m) for m in inner])
    return node


def _inner(node):
    """Through containers (ToDict, ...): the node that computes."""
    while isinstance(getattr(node, 'metric', None), Metric):
        node = node.metric
    return node


def _known(root):
    """True for torchbearer's own batch metrics (loss, accuracies, mse): batch means or per-sample values."""
    return type(root).__module__.startswith('torchbearer.') and not isinstance(root, (BatchLambda, EpochLambda))


class _Declarations:
    """How metrics are declared to combine: the ``metric_reduction`` names, then ``reduce_metric`` marks."""

    def __init__(self, reductions):
        self.reductions, self.used = reductions, set()

    def find(self, nodes, inherited=None):
        """The reduction declared for a metric made of ``nodes`` (itself, its root, its figures' nodes), or None."""
        names = []
        for node in nodes:
            for each in (node, _inner(node)):
                if getattr(each, 'name', None) not in names:
                    names.append(each.name)
        given = sorted({(name, self.reductions[name]) for name in names if name in self.reductions})
        self.used.update(name for name, _ in given)
        if len({reduction for _, reduction in given}) > 1:
            raise ValueError('metric_reduction gives one metric two reductions ({}), but its figures share one batch '
                             'value; give one'.format(', '.join('{!r}: {!r}'.format(*g) for g in given)))
        if given:
            return given[0][1]
        for node in nodes:
            for each in (node, _inner(node)):
                if getattr(each, _MARK, None) is not None:
                    return getattr(each, _MARK)
        return inherited


def _replacement(node, shared, declarations, declared=None):
    if type(node) is Mean:
        return _GlobalMean(node, shared)
    if type(node) in (Var, Std):
        return _GlobalVar(node, shared)
    if isinstance(node, RunningMean):
        return _RunningOverRanks(node, shared)
    if isinstance(node, EpochLambda):
        return _GatheredEpochLambda(node, shared)
    if isinstance(node, MetricTree):
        declared = declarations.find([node, node.root] + node.children, declared)
        if declared in ('sum', 'max', 'min', 'rank0'):
            return _CombinedTree(node, shared, declared)
        figures = [child.name for child in node.children if isinstance(_inner(child), _AGGREGATORS)]
        if declared is None and figures and not _known(node.root):
            node.root = _Assumed(node.root, shared, figures)
        node.children = [_replacement(child, shared, declarations) for child in node.children]
        return node
    declared = declarations.find([node], declared)
    for attribute in ('metric', 'metric_list'):  # ToDict, DefaultAccuracy, MetricList: containers of metrics
        inner = getattr(node, attribute, None)
        if isinstance(inner, Metric):
            setattr(node, attribute, _replacement(inner, shared, declarations, declared))
            return node
        if isinstance(inner, list):
            setattr(node, attribute, [_replacement(m, shared, declarations, declared) for m in inner])
            return node
    if declared is not None:
        return _CombinedFigures(node, shared, declared)
    return _SameOnEveryRank(node, shared)


def globalize(metric_list, shared):
    """Put distributed nodes in place of the aggregators of a Trial's MetricList, in place.

    Each call first restores torchbearer's own nodes, so that it can be repeated at every pass and a
    metric object used by a second Trial is bound to that Trial's ReduceMetrics and declarations.

    Raises:
        ValueError: ``shared.reductions`` names a metric the list does not hold, or gives one metric two
            reductions (on every rank alike, before any collective of the pass)
    """
    declarations = _Declarations(shared.reductions)
    metric_list.metric_list = [_replacement(_restore(m), shared, declarations) for m in metric_list.metric_list]
    unknown = sorted(set(shared.reductions) - declarations.used)
    if unknown:
        raise ValueError('metric_reduction names {}, which no metric of this Trial computes; name a metric or one of '
                         'its figures (such as \'peak\' or \'running_peak\')'.format(', '.join(map(repr, unknown))))
