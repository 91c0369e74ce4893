"""Metric nodes around metrics the package cannot inspect: the user's own, combined as declared or said.

A metric tree whose function the package does not know (``@mean`` over a ``@lambda_metric``) is
averaged as per-sample means and rank 0 says so once per Trial (:class:`Assumed`), unless it is declared
``'sum'``, ``'max'``, ``'min'`` or ``'rank0'`` (:class:`CombinedTree`: its batch values combined over
ranks, replayed through its aggregators). Any other metric is left as torchbearer computes it on each
rank and said where it differs (:class:`SameOnEveryRank`), or, declared, has its epoch figures combined
(:class:`CombinedFigures`).
"""
import copy

import torch

from torchbearer_dist.callbacks._aggregators import Wrapped, all_sum, extremes, reduced
from torchbearer_dist.sync import gather


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


class SameOnEveryRank(Wrapped):
    """Around any other metric (a max, an F1, a custom Metric): left as torchbearer computes it on each rank.

    This module cannot know how such a figure combines over ranks, so it never averages it. When its
    numeric epoch figures differ between ranks, rank 0 warns once per Trial that they are this rank's
    own; figures that agree on every rank (epoch, lr, ...) pass silently.
    """

    def process_final(self, *args):
        result = self.inner.process_final(*args)
        group = self._pass.group()
        if group.alone():
            return result
        numbers, names = _numbers(result, '')
        local = torch.tensor([float(numbers[k]) for k in names], dtype=torch.float64)
        high, low = reduced(lambda over: extremes(local, over), group)  # a synchronization point for every rank
        differ = [k or self.name for k, h, lo in zip(names, high.tolist(), low.tolist()) if h != lo]
        if differ:
            self._pass.say(('unknown', self.name), UNKNOWN.format(
                ', '.join(repr(k) for k in differ), type(self.inner).__name__, self.name))
        return result


class CombinedFigures(Wrapped):
    """Around a metric that is not a tree of aggregators, declared: its epoch figures combined over ranks.

    ``'sum'``, ``'max'`` and ``'min'`` reduce each numeric figure over ranks; ``'mean'`` weighs each
    rank's figure by the samples it saw in the pass; ``'rank0'`` gives every rank rank 0's figure.
    """

    def __init__(self, inner, shared, reduction):
        super().__init__(inner, shared)
        self._reduction = reduction

    def process_final(self, *args):
        result = self.inner.process_final(*args)
        group = self._pass.group()
        if group.alone():
            return result
        numbers, names = _numbers(result, self.name)
        local = torch.tensor([float(numbers[k]) for k in names] + [0.0], dtype=torch.float64)
        if self._reduction == 'mean':
            local = torch.cat([local[:-1] * self._pass.samples, local.new_tensor([self._pass.samples])])
        elif self._reduction == 'rank0' and group.rank() != 0:
            local.zero_()
        values = reduced(lambda over: self._combine(local, over), group)  # a synchronization point for every rank
        if values is None:
            return result  # the group could not complete it: this process's own figures
        if self._reduction == 'mean':
            values, samples = values[:-1], values[-1].item()
            values = values / samples if samples else values
        return _put(result, numbers, names, values[:len(names)].tolist())

    def _combine(self, local, group):
        """``local`` combined over ``group`` as declared; None over this process alone."""
        if group.alone():
            return None
        if self._reduction in ('max', 'min'):
            return extremes(local, group)[0 if self._reduction == 'max' else 1]
        return all_sum([local], group)[0]


class Assumed(Wrapped):
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
        if self._unsure and not self._pass.group().alone():
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


class CombinedTree(Wrapped):
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
        combined = reduced(self._combined, self._pass.group())
        if self._before is not None:
            self.inner.children, self._before = self._before, None
        result = {}
        for value in combined:
            result = _outputs(self.inner.children, 'process', value)
        final = _first(self.inner.root.process_final(*args))
        result.update(_outputs(self.inner.children, 'process_final', final))
        return result

    def _combined(self, group):
        """The batch values of one process at N x B, in batch order, over ``group`` (a synchronization point)."""
        values = [torch.as_tensor(v).detach().to(torch.float64).cpu() for v in self._values]
        shapes = sorted({tuple(v.shape) for v in values})
        rows = torch.tensor([[i, n, float(len(shapes) > 1)] for i, n in self._batches], dtype=torch.float64)
        rows, counts = gather.all_gather_rows(rows if len(rows) else None, group=group)
        if rows is not None and rows[:, 2].any():
            raise ValueError('metric {!r} is declared {!r}, which combines batch values of one shape, but its batch '
                             'values change shape between batches on some rank (this rank: {}); reduce each batch to '
                             'one shape, such as a scalar, or declare it \'mean\''.format(
                                 self.name, self._reduction, shapes))
        stacked, _ = gather.all_gather_rows(torch.stack(values) if values else None, group=group)
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
