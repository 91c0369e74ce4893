"""A metric ReduceMetrics does not know (a max) stays each rank's own figure, with one warning on rank 0."""
import warnings

import pytest
import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Trial
from torchbearer.bases import Metric
from torchbearer.metrics import ToDict

import torchbearer_dist

from _dist import run_workers


class _Max(Metric):
    """The largest prediction of the epoch: not a mean, so no average over ranks is right."""

    def __init__(self):
        super().__init__('max_pred')

    def process(self, state):
        self._max = max(self._max, state[torchbearer.Y_PRED].max().item())

    def process_final(self, state):
        return self._max

    def reset(self, state):
        self._max = float('-inf')


def _worker():
    torch.manual_seed(0)
    rank = torchbearer_dist.get_rank()
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x = torch.arange(4, dtype=torch.float32).reshape(4, 1) + 10 * rank  # rank 0: max 3, rank 1: max 13
    loader = DataLoader(TensorDataset(x, torch.zeros(4, 1)), batch_size=2)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), metrics=[ToDict(_Max())],
                  callbacks=[torchbearer_dist.ReduceMetrics()], verbose=0)
    trial.with_generators(val_generator=loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        first = trial.evaluate(data_key=torchbearer.VALIDATION_DATA)
        second = trial.evaluate(data_key=torchbearer.VALIDATION_DATA)
    said = [str(w.message) for w in caught if 'max_pred' in str(w.message)]
    return first['val_max_pred'], second['val_max_pred'], said


@pytest.mark.slow
def test_an_unknown_metric_is_left_per_rank_and_warned_once_on_rank_zero():
    (first0, second0, said0), (first1, second1, said1) = run_workers(_worker, 2, deadline=170)
    assert (first0, second0) == (3.0, 3.0)  # rank 0's own max, not (3 + 13) / 2 nor 13
    assert (first1, second1) == (13.0, 13.0)
    assert len(said0) == 1 and 'left as torchbearer computes it on each rank' in said0[0], said0
    assert said1 == []
