"""A metric ReduceMetrics does not know (a max) stays each rank's own figure, with one warning on rank 0 per Trial."""
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
    metric = ToDict(_Max())  # one metric object in both Trials, as a module-level metric would be
    trials = []
    for declared in (None, None, {'max_pred': 'max'}, {'max_pred': 'mean'}):
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), metrics=[metric],
                      callbacks=[torchbearer_dist.ReduceMetrics(metric_reduction=declared)], verbose=0)
        trials.append(trial.with_generators(val_generator=loader))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('default')  # as a user's program has it: Python shows a text once per line of code
        first = trials[0].evaluate(data_key=torchbearer.VALIDATION_DATA)
        second = trials[0].evaluate(data_key=torchbearer.VALIDATION_DATA)
        after_first = len(caught)
        third = trials[1].evaluate(data_key=torchbearer.VALIDATION_DATA)
        after_second = len(caught)
        declared = [t.evaluate(data_key=torchbearer.VALIDATION_DATA)['val_max_pred'] for t in trials[2:]]
    said = [[str(w.message) for w in part if 'max_pred' in str(w.message)]
            for part in (caught[:after_first], caught[after_first:after_second], caught[after_second:])]
    return first['val_max_pred'], second['val_max_pred'], third['val_max_pred'], declared, said


SAID = ("torchbearer_dist: metric 'max_pred' (_Max) is not one ReduceMetrics knows how to combine over ranks (Mean, "
        "Var, Std, RunningMean, EpochLambda); it differs between ranks and is left as torchbearer computes it on "
        "each rank, over that rank's samples only: what rank 0 prints, logs and checkpoints on is rank 0's; "
        "compute it in an EpochLambda (it then sees every rank's outputs), or say how its figures combine with "
        "metric_reduction={'max_pred': 'max'} (or 'sum', 'min', 'mean', 'rank0') or "
        "@torchbearer_dist.reduce_metric")


@pytest.mark.slow
def test_an_unknown_metric_is_left_per_rank_and_warned_once_per_trial_on_rank_zero():
    (first0, second0, third0, declared0, said0), (first1, second1, third1, declared1, said1) = run_workers(
        _worker, 2, deadline=170)
    assert (first0, second0, third0) == (3.0, 3.0, 3.0)  # rank 0's own max, not (3 + 13) / 2 nor 13
    assert (first1, second1, third1) == (13.0, 13.0, 13.0)
    assert said0 == [[SAID], [SAID], []]  # once in the first Trial's two evaluations, again in the second Trial
    assert said1 == [[], [], []]
    assert declared0 == declared1 == [13.0, 8.0]  # declared 'max': the max of all; 'mean': (3 * 4 + 13 * 4) / 8
