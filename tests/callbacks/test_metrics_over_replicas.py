"""ReduceMetrics handed a group (issue 43, item 2): over two real torchft replicas, the fail-fast mode's figures.

Each replica is a process of its own with a real torchft Manager at a real lighthouse, no process group: its
``ReduceMetrics(group=...)`` reduces over a ``QuorumGroup`` of the live replicas. Its figures (means, a Std,
EpochLambdas, a metric declared ``'max'``, Metrics declared or not, running figures) and its ``predict()`` must
equal, exactly, those two ranks of the fail-fast mode report on the same shards: with two members every sum is
``a + b``, whatever the wire. Over two replica groups of two ranks (``HierarchicalGroup``) they equal those
over the flat group of the four. Where the group cannot complete a reduction, or there is none, the figures are
the process's own.
"""
import copy
import warnings

import pytest
import torch
import torchbearer
from _manager import StandInManager
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Metric, Trial, metrics
from torchbearer.metrics import EpochLambda
from torchbearer.metrics.roc_auc_score import RocAucScore

import torchbearer_dist
from torchbearer_dist.callbacks.metrics import ReduceMetrics
from torchbearer_dist.sync.gather import IncompleteGather
from torchbearer_dist.sync.group import DistGroup, HierarchicalGroup, QuorumGroup

from _dist import LOAD_SLACK, STARTUP, run_workers

TRAIN, VAL, B = 64, 101, 16  # VAL odd: the padding sampler repeats one sample, dropped; ragged last batches


def _data(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _median_error(y_pred, y_true):  # not a mean: computed on every member's outputs, gathered
    return (y_pred.softmax(1).max(1).values - y_true.float() / 2).abs().median().item()


@metrics.running_mean
@metrics.mean
@torchbearer_dist.reduce_metric('max')
@metrics.lambda_metric('peak')
def _peak(y_pred, y_true):  # each batch's maximum confidence: combined batch by batch as declared
    return y_pred.softmax(1).max()


class _Seen(Metric):
    """A Metric that is no tree of aggregators: the samples this process saw in the pass (differs by rank)."""

    def __init__(self, name):
        super().__init__(name)
        self.seen = 0

    def process(self, state):
        self.seen += state[torchbearer.Y_TRUE].size(0)

    def process_final(self, state):
        return float(self.seen)

    def reset(self, state):
        self.seen = 0


def _metrics():
    errors = metrics.MetricTree(metrics.BatchLambda('error', lambda y_pred, y_true: (y_pred.argmax(1) - y_true)
                                                    .abs().float()))
    errors.add_child(metrics.ToDict(metrics.Mean('error')))
    errors.add_child(metrics.ToDict(metrics.Std('error_std')))
    return ['loss', 'acc', errors, RocAucScore(one_hot_classes=3), _peak, metrics.ToDict(_Seen('seen')),
            metrics.ToDict(_Seen('seen_total')),
            metrics.ToDict(EpochLambda('median', _median_error, running=False))]


def _trial(rank, replicas, group=None):
    """A Trial on shard ``rank`` of ``replicas`` (lr 0: the weights stay, no gradient travels)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    loaders = [DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, replicas, rank, shuffle=False))
               for dataset in (TensorDataset(*_data(TRAIN, 1)), TensorDataset(*_data(VAL, 2)),
                               TensorDataset(_data(VAL, 3)[0]))]
    reduce = ReduceMetrics(metric_reduction={'seen_total': 'sum'}, group=group)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), metrics=_metrics(),
                  callbacks=[reduce], verbose=0)
    return trial.with_generators(train_generator=loaders[0], val_generator=loaders[1], test_generator=loaders[2])


def _figures(trial):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # rank 0 says that 'seen' differs between ranks: heard in test_unknown_metric
        evaluated = trial.evaluate(data_key=torchbearer.VALIDATION_DATA)
        predicted = trial.predict()
        history = trial.run(1)
    return {'evaluate': evaluated, 'predict': predicted, 'run': history[-1]}


def _fail_fast():
    return _figures(_trial(torchbearer_dist.get_rank(), 2))


def _replica(lighthouse):
    import os

    from torchbearer_dist.ft.replica import Replica
    rank = int(os.environ['RANK'])
    replica = Replica(lighthouse, 'r{}'.format(rank), lambda state: None, lambda: {}, min_replicas=2, timeout=20.0,
                      host='127.0.0.1')
    try:
        replica.start_quorum(heal=False)  # both fresh at step 0: nothing healed; every reduction in this quorum
        assert replica.manager.num_participants() == 2
        return _figures(_trial(rank, 2, group=lambda: QuorumGroup(replica.manager)))
    finally:
        replica.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(2 * (STARTUP + LOAD_SLACK) + 60)
def test_figures_over_two_torchft_replicas_equal_the_fail_fast_modes_exactly():
    pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')
    from torchbearer_dist.ft import Lighthouse
    fail_fast = run_workers(_fail_fast, world_size=2)
    with Lighthouse(bind='127.0.0.1:0', min_replicas=2, join_timeout=STARTUP, heartbeat_timeout=5.0) as lighthouse:
        url = 'http://127.0.0.1:' + lighthouse.address.rsplit(':', 1)[1]
        replicas = run_workers(_replica, world_size=2, group='none', args=(url,), deadline=STARTUP + 30)
    for found, expected in zip(replicas, fail_fast):
        assert found['evaluate'] == expected['evaluate'] and found['run'] == expected['run'], (found, expected)
        assert torch.equal(found['predict'], expected['predict'])
    # every figure the same on both, but an undeclared Metric's, each replica's own (padding dropped on shard 1)
    assert [found['run'].pop('val_seen') for found in replicas] == [51.0, 50.0]
    figures = replicas[0]['run']
    assert figures == replicas[1]['run'] and figures['seen_total'] == TRAIN and figures['val_seen_total'] == VAL
    assert set(figures) >= {'loss', 'running_loss', 'acc', 'error', 'error_std', 'roc_auc_score', 'peak',
                            'running_peak', 'median', 'val_loss', 'val_roc_auc_score', 'val_peak', 'val_median',
                            'val_error_std'}
    assert replicas[0]['predict'].shape == (VAL, 3)


def _over_replica_groups():
    """Ranks {0, 1} and {2, 3} as two replica groups, {0, 2} and {1, 3} across them (a real process group where
    the fault-tolerant mode has torchft's quorum): the figures over them, and over the flat group of the four."""
    rank = torch.distributed.get_rank()
    local = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])][rank // 2]
    across = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])][rank % 2]
    group = HierarchicalGroup(DistGroup(local), DistGroup(across))
    return {'groups': _figures(_trial(rank, 4, group=group)), 'flat': _figures(_trial(rank, 4))}


@pytest.mark.slow
@pytest.mark.timeout(STARTUP + LOAD_SLACK + 60)
def test_figures_over_replica_groups_of_two_ranks_equal_those_over_the_flat_group():
    for found in run_workers(_over_replica_groups, world_size=4):
        groups, flat = found['groups'], found['flat']
        assert groups['run'].pop('val_seen') == flat['run'].pop('val_seen')  # each rank's own, undeclared
        for key in ('evaluate', 'run'):  # sums of four in another order: equal to float64 rounding
            assert groups[key].keys() == flat[key].keys()
            for name, value in flat[key].items():
                assert groups[key][name] == pytest.approx(value, rel=1e-12, abs=1e-15), (key, name)
        assert torch.equal(groups['predict'], flat['predict'])


def test_figures_a_torchft_failure_left_incomplete_are_this_processs_own_and_predict_raises():
    own = _trial(1, 2, group=lambda: None)  # its group function says it talks to nobody: its own shard's figures
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # and no warning that figures differ between ranks: there is no other
        alone = own.evaluate(data_key=torchbearer.VALIDATION_DATA)
    manager = StandInManager(rank=1, error=RuntimeError('peer lost'))
    failing = _trial(1, 2, group=QuorumGroup(manager))
    assert failing.evaluate(data_key=torchbearer.VALIDATION_DATA) == alone and len(manager.sent) > 3
    assert alone['val_seen'] == alone['val_seen_total'] == (VAL - 1) // 2  # shard 1: no repeat of the padding
    with pytest.raises(IncompleteGather, match=r'^a gather over the live replicas was not whole'):
        failing.predict()


def test_a_copied_reduce_metrics_shares_its_group_instead_of_copying_a_live_quorum():
    manager = StandInManager()
    for group in (QuorumGroup(manager), lambda: QuorumGroup(manager)):
        copied = copy.deepcopy(ReduceMetrics(group=group))
        assert copied._pass.source is group and copied.group is group


def test_a_group_that_is_neither_a_group_nor_a_function_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^group should be None \(the default process group\), a group of "
                                         r"torchbearer_dist.sync.group or a function of no argument returning one "
                                         r"\(or None\), but given 'world'$"):
        ReduceMetrics(group='world')
