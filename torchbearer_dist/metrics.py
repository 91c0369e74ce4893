"""Global epoch metrics: every rank reports the figures of the union of all ranks' data."""
import torch
import torchbearer
from torch.utils.data import DistributedSampler
from torchbearer import Callback

from torchbearer_dist import comm


class _GlobalMetricList:
    """Wraps a Trial's MetricList so that epoch metrics are averaged over ranks, weighted by samples."""

    def __init__(self, inner):
        self.inner = inner
        self.samples = 0
        self.last = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __str__(self):
        return str(self.inner)

    def reset(self, state):
        self.samples = 0
        self.last = {}
        return self.inner.reset(state)

    def process(self, state):
        n = _batch_size(state)
        if n == 0:
            return {}
        self.samples += n
        self.last = self.inner.process(state)
        return self.last

    def process_final(self, state):
        # The last batch's running figures (running_loss, ...) stay in the epoch's metrics: reduce them too,
        # so that every rank reports, logs and checkpoints on the same numbers.
        values = {k: v for k, v in self.last.items() if k.startswith('running_')}
        values.update(self.inner.process_final(state))
        scalars = {k: v for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   or isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()}
        for name, value in comm.weighted_means(scalars, self.samples).items():
            original = scalars[name]
            values[name] = torch.tensor(value, dtype=original.dtype) if isinstance(original, torch.Tensor) else value
        return values


def _batch_size(state):
    for key in (torchbearer.Y_TRUE, torchbearer.X):
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.size(0)
    return 1


def _trim(value, keep):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[:keep]
    if isinstance(value, (list, tuple)):
        return type(value)(_trim(v, keep) for v in value)
    return value


class ReduceMetrics(Callback):
    """Report epoch metrics over the union of all ranks' data, identical on every rank.

    Each epoch metric that is a number (loss, acc, and any averaging torchbearer metric) is averaged
    over ranks, weighted by the samples each rank saw, so the printed figures equal those over all
    the data. The last batch's running figures (``running_loss``, ...), which torchbearer keeps in the
    epoch's metrics, are averaged in the same reduction, so every rank holds the same history. Under a
    padding DistributedSampler, validation drops the repeated samples, so each sample counts exactly once.

    Example: ::

        >>> from torchbearer_dist import ReduceMetrics
        >>> trial = Trial(torch.nn.Linear(2, 1), metrics=['loss'], callbacks=[ReduceMetrics()])

    State Requirements:
        - :attr:`torchbearer.state.METRIC_LIST`: wrapped on init
        - :attr:`torchbearer.state.X`, :attr:`torchbearer.state.Y_TRUE`: counted per batch

    .. warning:: A synchronization point at the end of each training and validation pass.
    """

    def __init__(self):
        super().__init__()
        self._remaining = None

    def on_init(self, state):
        metrics = state[torchbearer.METRIC_LIST]
        if not isinstance(metrics, _GlobalMetricList):
            state[torchbearer.METRIC_LIST] = _GlobalMetricList(metrics)

    def on_start_validation(self, state):
        self._remaining = None
        sampler = getattr(state.get(torchbearer.GENERATOR), 'sampler', None)
        if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
            total = len(sampler.dataset)
            self._remaining = len(range(sampler.rank, total, sampler.num_replicas))

    def on_sample_validation(self, state):
        if self._remaining is None:
            return
        n = _batch_size(state)
        keep = min(n, self._remaining)
        self._remaining -= keep
        if keep < n:
            for key in (torchbearer.X, torchbearer.Y_TRUE):
                if key in state:
                    state[key] = _trim(state[key], keep)
