"""Every figure global, or said (issue 26, item 3): metrics whose batch value is not a per-sample mean.

One start of the ranks runs three Trials in one process (run_in_step), with the metrics a user
writes at module level with torchbearer's decorators, so the second and third Trials reuse the
first one's metric objects. The reference is one process at N x B running the same three Trials,
with torchbearer alone (no ReduceMetrics), in a fresh process of its own.

- ``peak`` (each batch's maximum confidence, ``@running_mean @mean @std``), declared 'max' with
  :func:`torchbearer_dist.reduce_metric`; ``trough`` (the minimum), declared 'min' through the
  ``metric_reduction`` argument by one of its figures' names; ``hits`` (correct answers per batch),
  declared 'sum': every figure equals one process at N x B.
- ``peak_raw``: the same function undeclared: averaged as a mean (not one process's figure), and
  rank 0 warns once in each Trial, naming the metric and the assumption.
- A user F1: as an EpochLambda it equals one process; as a Metric class it is rank 0's own, warned
  once in each Trial; declared 'rank0', every rank reports rank 0's figure, silently.
"""
import warnings

import pytest
import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial, metrics
from torchbearer.bases import Metric

import torchbearer_dist
from torchbearer_dist.callbacks import _aggregators

from _dist import run_in_step, run_workers, scenario_values

B = 16  # per rank
VAL = 101  # odd: a padding sampler repeats a sample, and the last batches are ragged
DECLARED = {'running_trough': 'min', 'hits': 'sum'}  # a figure's name declares the whole metric


@metrics.running_mean(step_size=1)
@metrics.mean
@metrics.std
@torchbearer_dist.reduce_metric('max')
@metrics.lambda_metric('peak')
def peak(y_pred, y_true):
    return y_pred.softmax(1).max()  # the batch's maximum confidence: not a mean


@metrics.running_mean(step_size=1)
@metrics.mean
@metrics.lambda_metric('peak_raw')
def peak_raw(y_pred, y_true):
    return y_pred.softmax(1).max()


@metrics.running_mean(step_size=1)
@metrics.mean
@metrics.lambda_metric('trough')
def trough(y_pred, y_true):
    return y_pred.softmax(1).max(1).values.min()


@metrics.mean
@metrics.lambda_metric('hits')
def hits(y_pred, y_true):
    return (y_pred.argmax(1) == y_true).sum().float()


def _f1(y_pred, y_true):
    """Macro F1 over the 3 classes: not a mean of anything per batch."""
    guess, scores = y_pred.argmax(1), []
    for c in range(3):
        tp = ((guess == c) & (y_true == c)).sum().item()
        wrong = ((guess == c) != (y_true == c)).sum().item()
        scores.append(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
    return sum(scores) / 3


class F1(Metric):
    """A user F1 as a Metric class: counts over the epoch, the figure at its end."""

    def __init__(self):
        super().__init__('f1_class')

    def process(self, state):
        self._pred.append(state[torchbearer.Y_PRED].detach())
        self._true.append(state[torchbearer.Y_TRUE])

    def process_final(self, state):
        return _f1(torch.cat(self._pred), torch.cat(self._true))

    def reset(self, state):
        self._pred, self._true = [], []


f1_epoch = metrics.to_dict(metrics.lambda_metric('f1_epoch', on_epoch=True)(_f1))
f1_class = metrics.to_dict(F1())
METRICS = ['loss', peak, peak_raw, trough, hits, f1_epoch, f1_class]


def _data(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _loader(dataset, batch, shuffle):
    world, rank = torchbearer_dist.get_world_size(), torchbearer_dist.get_rank()
    return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, world, rank, shuffle=shuffle,
                                                                           seed=3))


def _trial(world, batch, callbacks, epochs, seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), metrics=METRICS,
                  callbacks=callbacks, verbose=0)
    train = TensorDataset(*_data(4 * world * B, seed + 1))  # 4 full batches of N x B
    trial.with_generators(train_generator=_loader(train, batch, True),
                          val_generator=_loader(TensorDataset(*_data(VAL, seed + 2)), batch, False))
    return trial.run(epochs)


def _said(caught, start):
    return [str(w.message) for w in caught[start:] if str(w.message).startswith('torchbearer_dist: metric')]


def _three_trials(world, batch, distributed):
    """Trials A (2 epochs), B (1 epoch) and C (1 epoch, F1 class and peak_raw declared) in one process.

    Python's default filter is kept for all three, as a user's program has it: it would show a
    text once per line of code, so a second Trial hears it only if the package says it again.
    """
    def callbacks(extra=None):
        if not distributed:
            return [torchbearer_dist.SetSamplerEpoch()]
        return torchbearer_dist.distributed_callbacks(metric_reduction={**DECLARED, **(extra or {})})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('default')
        a = _trial(world, batch, callbacks(), 2, 0)
        after_a = len(caught)
        b = _trial(world, batch, callbacks(), 1, 10)
        after_b = len(caught)
        c = _trial(world, batch, callbacks({'f1_class': 'rank0', 'peak_raw': 'mean'}), 1, 20)
    return {'history': (a, b, c), 'said': (_said(caught[:after_a], 0), _said(caught[:after_b], after_a),
                                           _said(caught, after_b))}


def _worker(world):
    torch.set_num_threads(1)
    return run_in_step([('trials', lambda: _three_trials(world, B, True))])


def _reference(world):
    torch.set_num_threads(1)
    return _three_trials(world, world * B, False)


@pytest.fixture(scope='module', params=[2, 3])
def figures(request):
    world = request.param
    ranks = scenario_values(run_workers(_worker, world, args=(world,), deadline=240), 'trials')
    alone = run_workers(_reference, 1, args=(world,), deadline=120)[0]
    return world, ranks, alone


EXACT = ['loss', 'running_loss', 'peak', 'running_peak', 'peak_std', 'val_peak', 'val_peak_std', 'trough',
         'running_trough', 'val_trough', 'hits', 'val_hits', 'f1_epoch', 'val_f1_epoch']


ASSUMED = ("torchbearer_dist: metric 'peak_raw' ('peak_raw', 'running_peak_raw') comes from a function ReduceMetrics "
            "cannot inspect, so each batch's value is assumed to be a mean over the batch's samples and averaged over "
            "ranks; if it is a sum, a max, a min or rank 0's own, say so with metric_reduction={'peak_raw': 'max'} (an "
            "argument of distributed_callbacks() and ReduceMetrics) or @torchbearer_dist.reduce_metric('max'), or "
           "'mean' to confirm it")


UNKNOWN = ("torchbearer_dist: metric 'f1_class' (F1) is not one ReduceMetrics knows how to combine over ranks (Mean, "
           "Var, Std, RunningMean, EpochLambda); it differs between ranks and is left as torchbearer computes it on "
           "each rank, over that rank's samples only: what rank 0 prints, logs and checkpoints on is rank 0's; "
           "compute it in an EpochLambda (it then sees every rank's outputs), or say how its figures combine with "
           "metric_reduction={'f1_class': 'max'} (or 'sum', 'min', 'mean', 'rank0') or "
           "@torchbearer_dist.reduce_metric")


@pytest.mark.slow
def test_declared_and_known_figures_equal_one_process_at_n_times_b(figures):
    world, ranks, alone = figures
    for trial in range(3):
        reference = alone['history'][trial]
        for epoch, expected in enumerate(reference):
            for name in EXACT:
                for rank, result in enumerate(ranks):
                    torch.testing.assert_close(result['history'][trial][epoch][name], expected[name], rtol=0,
                                               atol=2e-6, msg='{} (trial {}, epoch {}, rank {}, {} ranks)'.format(
                                                   name, trial, epoch, rank, world))


@pytest.mark.slow
def test_an_undeclared_batch_max_is_averaged_and_said_once_in_each_trial(figures):
    world, ranks, alone = figures
    first = ranks[0]['history'][0][0]
    reference = alone['history'][0][0]
    assert first['peak_raw'] < reference['peak_raw'] - 1e-3  # the mean over ranks of maxima is below the max
    assert first['peak'] == pytest.approx(reference['peak'], abs=2e-6)
    said = ranks[0]['said']
    assert sorted(said[0]) == sorted(said[1]) == sorted([ASSUMED, UNKNOWN])  # known and declared ones are silent
    assert [s for s in said[0] if 'peak_raw' in s] == [ASSUMED]
    assert [s for s in said[1] if 'peak_raw' in s] == [ASSUMED]  # the second Trial hears it again
    assert [s for s in said[2] if 'peak_raw' in s] == []  # declared 'mean'
    assert all(s == ([], [], []) for s in (r['said'] for r in ranks[1:]))


@pytest.mark.slow
def test_a_user_f1_class_is_rank_zeros_own_and_said_and_rank0_declared_is_silent(figures):
    world, ranks, alone = figures
    said = ranks[0]['said']
    assert [s for s in said[0] if 'f1_class' in s] == [UNKNOWN]
    assert [s for s in said[1] if 'f1_class' in s] == [UNKNOWN]
    assert said[2] == []
    a = [r['history'][0][-1]['val_f1_class'] for r in ranks]
    assert len(set(a)) == world, a  # each rank's own
    c = [r['history'][2][-1][name] for r in ranks for name in ('f1_class', 'val_f1_class')]
    assert c == [c[0], c[1]] * world  # rank 0's on every rank


def test_reduce_metric_and_metric_reduction_refuse_unknown_values_at_construction():
    allowed = "'mean', 'sum', 'max', 'min', 'rank0'"
    with pytest.raises(ValueError, match=r"^reduce_metric's reduction should be one of {}, but given 'maximum'$".format(
            allowed)):
        torchbearer_dist.reduce_metric('maximum')
    with pytest.raises(ValueError, match=r"^metric_reduction\['running_peak'\] should be one of {}, but given "
                                         r"'maximum'$".format(allowed)):
        torchbearer_dist.ReduceMetrics(metric_reduction={'running_peak': 'maximum'})
    with pytest.raises(ValueError, match=r"^metric_reduction\['peak'\] should be one of"):
        torchbearer_dist.distributed_callbacks(metric_reduction={'peak': 'average'})
    with pytest.raises(ValueError, match=r"^metric_reduction should be a dict of metric names to one of"):
        torchbearer_dist.ReduceMetrics(metric_reduction='max')
    with pytest.raises(ValueError, match=r"^reduce_metric decorates a torchbearer Metric"):
        torchbearer_dist.reduce_metric('max')(lambda y_pred, y_true: 0)


def _evaluate_alone(metric_list, metric_reduction):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trial = Trial(model, None, nn.CrossEntropyLoss(), metrics=metric_list, verbose=0,
                  callbacks=[torchbearer_dist.ReduceMetrics(metric_reduction=metric_reduction)])
    trial.with_generators(val_generator=DataLoader(TensorDataset(*_data(VAL, 2)), batch_size=B))
    return trial.evaluate(data_key=torchbearer.VALIDATION_DATA)


def test_a_name_no_metric_computes_or_two_reductions_for_one_metric_stop_the_pass():
    with pytest.raises(ValueError, match=r"^metric_reduction names 'runing_peak', which no metric of this Trial "
                                         r"computes; name a metric or one of its figures"):
        _evaluate_alone(['loss', peak], {'runing_peak': 'max'})
    with pytest.raises(ValueError, match=r"^metric_reduction gives one metric two reductions \('peak': 'max', "
                                         r"'running_peak': 'mean'\), but its figures share one batch value; give one$"):
        _evaluate_alone(['loss', peak], {'peak': 'max', 'running_peak': 'mean'})


def test_one_process_reports_what_torchbearer_reports():
    """In a job of one process the declared path replays the batch values: the same figures, in float64."""
    plain = Trial(nn.Linear(4, 3), None, nn.CrossEntropyLoss(), metrics=['loss', peak, trough, hits], verbose=0)
    torch.manual_seed(0)
    plain.state[torchbearer.MODEL].load_state_dict(nn.Linear(4, 3).state_dict())
    plain.with_generators(val_generator=DataLoader(TensorDataset(*_data(VAL, 2)), batch_size=B))
    expected = plain.evaluate(data_key=torchbearer.VALIDATION_DATA)
    got = _evaluate_alone(['loss', peak, trough, hits], DECLARED)
    assert set(got) == set(expected)
    for name in set(expected) - {'val_loss'}:  # the loss is a per-sample mean, and the last batch is ragged
        assert got[name] == pytest.approx(expected[name], abs=1e-6), name


def test_reduce_metric_marks_what_it_decorates_and_returns_it():
    tree = metrics.mean(metrics.lambda_metric('x')(lambda y_pred, y_true: y_pred))
    assert torchbearer_dist.reduce_metric('sum')(tree) is tree
    assert getattr(tree, _aggregators._MARK) == 'sum'

    @torchbearer_dist.reduce_metric('rank0')
    class Mine(Metric):
        pass

    assert getattr(Mine('m'), _aggregators._MARK) == 'rank0'
