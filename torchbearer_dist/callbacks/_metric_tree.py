"""Which node stands where: :func:`globalize` rewrites a Trial's metric tree with the distributed nodes.

The one place that rewrites torchbearer objects: each aggregator of torchbearer's (``Mean``, ``Var``,
``Std``, ``RunningMean``, ``EpochLambda``) gets its node of :mod:`~torchbearer_dist.callbacks._aggregators`;
a metric the package cannot inspect gets one of :mod:`~torchbearer_dist.callbacks._custom_metrics`, as
its declaration says (``metric_reduction`` names first, then ``reduce_metric`` marks).
"""
from torchbearer.bases import Metric
from torchbearer.metrics import BatchLambda, EpochLambda, Mean, MetricTree, RunningMean, Std, Var

from torchbearer_dist.callbacks._aggregators import (
    GatheredEpochLambda,
    GlobalMean,
    GlobalVar,
    RunningOverRanks,
    Wrapped,
    marked,
)
from torchbearer_dist.callbacks._custom_metrics import Assumed, CombinedFigures, CombinedTree, SameOnEveryRank

_AGGREGATORS = (Mean, Var, Std, RunningMean)


def _restore(node):
    """The torchbearer node a distributed one stands for, its containers restored too (in place)."""
    while isinstance(node, (Wrapped, GlobalMean, GlobalVar)):
        node = node.inner if isinstance(node, Wrapped) else node.original
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
                if marked(each) is not None:
                    return marked(each)
        return inherited


def _replacement(node, shared, declarations, declared=None):
    if type(node) is Mean:
        return GlobalMean(node, shared)
    if type(node) in (Var, Std):
        return GlobalVar(node, shared)
    if isinstance(node, RunningMean):
        return RunningOverRanks(node, shared)
    if isinstance(node, EpochLambda):
        return GatheredEpochLambda(node, shared)
    if isinstance(node, MetricTree):
        declared = declarations.find([node, node.root] + node.children, declared)
        if declared in ('sum', 'max', 'min', 'rank0'):
            return CombinedTree(node, shared, declared)
        figures = [child.name for child in node.children if isinstance(_inner(child), _AGGREGATORS)]
        if declared is None and figures and not _known(node.root):
            node.root = Assumed(node.root, shared, figures)
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
        return CombinedFigures(node, shared, declared)
    return SameOnEveryRank(node, shared)


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
