"""Distributed aggregators: torchbearer Metric nodes whose epoch figures cover every rank's samples.

torchbearer aggregates a metric in :class:`~torchbearer.bases.Metric` nodes of a tree (``Mean``,
``Std``, ``RunningMean``, ``EpochLambda`` under ``ToDict`` and ``MetricTree``) and offers no hook between
a metric's per-batch values and its epoch figure. Its Metric classes are its extension point, so
:func:`globalize` puts the nodes of this module in place of those aggregators in a Trial's metric tree:
the one place that rewrites torchbearer objects. The figures are then global before any printer,
logger or checkpointer reads them.
"""
import torch
import torch.distributed as dist
from torchbearer.bases import Metric
from torchbearer.metrics import EpochLambda, Mean, MetricTree, RunningMean, Std, Var

from torchbearer_dist import _torchbearer
from torchbearer_dist._once import warn_once
from torchbearer_dist.sync import collectives, gather


class Pass:
    """What the distributed metric nodes share with their ReduceMetrics: the pass, and the batch size now."""

    def __init__(self):
        self.training, self.batch, self.samples = True, 1, 0


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

    def __init__(self, name, dim, shared):
        super().__init__(name)
        self._dim, self._pass = dim, shared
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

    def __init__(self, name, unbiased, dim, std, shared):
        super().__init__(name)
        self._unbiased, self._dim, self._std, self._pass = unbiased, dim, std, shared
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


class _SameOnEveryRank(_Wrapped):
    """Around any other metric (a max, an F1, a custom Metric): left as torchbearer computes it on each rank.

    This module cannot know how such a figure combines over ranks, so it never averages it. When its
    numeric epoch figures differ between ranks, rank 0 warns once per metric name that they are this
    rank's own; figures that agree on every rank (epoch, lr, ...) pass silently.
    """

    def process_final(self, *args):
        result = self.inner.process_final(*args)
        if collectives.world_size() == 1:
            return result
        numbers = result if isinstance(result, dict) else {'': result}
        names = sorted(k for k, v in numbers.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                       or isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point())
        local = torch.tensor([float(numbers[k]) for k in names], dtype=torch.float64)
        both = torch.cat([local, -local]).to(collectives.comm_device(torch.device('cpu')))
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # a synchronization point for every rank alike
        high, low = both[:len(names)].cpu(), -both[len(names):].cpu()
        differ = [k or self.name for k, h, lo in zip(names, high.tolist(), low.tolist()) if h != lo]
        if differ and collectives.rank() == 0:
            warn_once(UNKNOWN.format(', '.join(repr(k) for k in differ), type(self.inner).__name__))
        return result


UNKNOWN = ('torchbearer_dist: metric {} ({}) is not one ReduceMetrics knows how to combine over ranks (Mean, '
           'Var, Std, RunningMean, EpochLambda); it differs between ranks and is left as torchbearer computes it '
           'on each rank, over that rank\'s samples only: what rank 0 prints, logs and checkpoints on is rank 0\'s')


_OURS = (_GlobalMean, _GlobalVar, _Wrapped)


def _replacement(node, shared):
    if isinstance(node, _OURS):
        return node
    if type(node) is Mean:
        return _GlobalMean(node.name, _torchbearer.mean_dim(node), shared)
    if type(node) in (Var, Std):
        return _GlobalVar(node.name, _torchbearer.var_unbiased(node), _torchbearer.mean_dim(node), type(node) is Std,
                          shared)
    if isinstance(node, RunningMean):
        return _RunningOverRanks(node, shared)
    if isinstance(node, EpochLambda):
        return _GatheredEpochLambda(node, shared)
    if isinstance(node, MetricTree):
        node.children = [_replacement(child, shared) for child in node.children]
        return node
    for attribute in ('metric', 'metric_list'):  # ToDict, DefaultAccuracy, MetricList: containers of metrics
        inner = getattr(node, attribute, None)
        if isinstance(inner, Metric):
            setattr(node, attribute, _replacement(inner, shared))
            return node
        if isinstance(inner, list):
            setattr(node, attribute, [_replacement(m, shared) for m in inner])
            return node
    return _SameOnEveryRank(node, shared)


def globalize(metric_list, shared):
    """Put distributed nodes in place of the aggregators of a Trial's MetricList, in place (idempotent)."""
    metric_list.metric_list = [_replacement(m, shared) for m in metric_list.metric_list]
