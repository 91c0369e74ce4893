"""The synchronizing callbacks on two real ranks: broadcast, gradients, faults, stops and uneven data.

All scenarios run in one launch of two ranks (a spawn costs seconds on a small machine); each test
checks its own scenario. A scenario that must raise asserts that on every rank with
``pytest.raises(..., match=)`` and then meets the other rank in a barrier: the process group
survived, no rank aborted or hangs. After a scenario fails on any rank, the rest are not run.
"""
import copy
import datetime
import io
import warnings
from contextlib import redirect_stderr

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist
from torchbearer_dist import (
    AllReduceGradients,
    BroadcastParameters,
    CheckReplicas,
    EvenBatches,
    FlattenImages,
    distributed_callbacks,
)

from _dist import PG_TIMEOUT, run_in_step, run_workers, scenario_values


def _rank():
    return dist.get_rank()


def _snapshot(model):
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _grads(model):
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _loader(samples, features=4, outputs=1, batch_size=4, seed=0, rank=None):
    """A fixed-order loader of this rank's own data (of rank ``rank``'s, for a reference in one process)."""
    generator = torch.Generator().manual_seed(seed + 1000 * (_rank() if rank is None else rank))
    x = torch.randn(samples, features, generator=generator)
    y = torch.randn(samples, outputs, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class _Record(Callback):
    """Counts optimizer steps per epoch and keeps the parameters after each step."""

    def __init__(self):
        super().__init__()
        self.steps, self.params, self.grads, self.state = {}, [], [], {}

    def on_step_training(self, state):
        epoch = state[torchbearer.EPOCH]
        self.steps[epoch] = self.steps.get(epoch, 0) + 1
        model = state[torchbearer.MODEL]
        self.params.append(_snapshot(model))
        self.grads.append(_grads(model.module if isinstance(model, DistributedDataParallel) else model))

    def on_end(self, state):
        self.state = {'skipped': state.get(torchbearer_dist.SKIPPED_STEPS)}


def _sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr)


# Scenarios: each runs on both ranks and returns what the parent checks.

def _scenario_broadcast(method):
    torch.manual_seed(10 + _rank())
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        model[1].running_mean.fill_(_rank() + 1.0)
        model[1].running_var.fill_(_rank() + 2.0)
        model[1].num_batches_tracked.fill_(_rank() + 7)
    before = _snapshot(model)
    trial = Trial(model, callbacks=[BroadcastParameters(method=method)])
    built = _snapshot(model)  # nothing moves when the Trial is built: init callbacks may still follow
    _start(trial)
    return {'before': before, 'built': built, 'after': _snapshot(model)}


def _start(trial):
    """Run one epoch of no steps: the callbacks' on_start and on_start_epoch, no training."""
    trial.for_train_steps(0).run(1, verbose=0)


def _scenario_mismatch():
    messages = []
    with pytest.raises(RuntimeError, match=r"the model differs across ranks at state_dict entry 0: rank 0 has "
                                           r"'weight' \(1, 10\) float32, rank 1 has 'weight' \(1, 11\) float32"):
        try:
            _start(Trial(nn.Linear(10 + _rank(), 1), callbacks=[BroadcastParameters()]))
        except RuntimeError as error:
            messages.append(str(error))
            raise
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2 + _rank()))
    with pytest.raises(RuntimeError, match=r"entry 2: rank 0 has '1.weight' \(2, 3\) float32, "
                                           r"rank 1 has '1.weight' \(3, 3\) float32"):
        try:
            _start(Trial(model, callbacks=[BroadcastParameters(method='p2p')]))
        except RuntimeError as error:
            messages.append(str(error))
            raise
    dist.barrier()  # the group is alive: no collective of mismatched size ran
    return messages


class _Branchy(nn.Module):
    """``branch`` is used on rank 1 only, ``unused`` nowhere, ``frozen`` everywhere but never trained."""

    def __init__(self, use_branch):
        super().__init__()
        self.use_branch = use_branch
        self.shared = nn.Linear(4, 2)
        self.branch = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)
        self.frozen = nn.Linear(4, 2).requires_grad_(False)

    def forward(self, x):
        out = self.shared(x) + self.frozen(x)
        return out + self.branch(x) if self.use_branch else out


def _local_grads(model, loader):
    """This rank's own gradients of the first batch, without any synchronization."""
    local = copy.deepcopy(model)
    x, y = next(iter(loader))
    nn.functional.mse_loss(local(x), y).backward()
    return _grads(local)


def _scenario_unused_and_frozen():
    torch.manual_seed(20 + _rank())
    model = _Branchy(use_branch=_rank() == 1)
    loader = _loader(8, outputs=2, batch_size=8)
    reduce, record = AllReduceGradients(), _Record()
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[BroadcastParameters(), reduce, record], verbose=0)
    torchbearer_dist.sync.models.broadcast_state(model)  # as the Trial will at its first epoch
    frozen_before = _snapshot(model.frozen)
    local = _local_grads(model, loader)
    trial.with_train_generator(loader).run(1)
    names = {id(p): name for name, p in model.named_parameters()}
    communicated = sorted(names[id(p)] for p in reduce.buckets.params)
    return {'local': local, 'synced': record.grads[0], 'frozen_before': frozen_before,
            'frozen_after': _snapshot(model.frozen), 'communicated': communicated}


def _scenario_ddp_model():
    torch.manual_seed(30)
    model = DistributedDataParallel(nn.Linear(4, 2))
    loader = _loader(8, outputs=2, batch_size=8)
    local = _local_grads(model.module, loader)
    reduce, record = AllReduceGradients(), _Record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[reduce, record], verbose=0)
        trial.with_train_generator(loader).run(1)
        trial.run(2)  # a second run starts the callbacks again
    ours = [str(w.message) for w in caught if 'already DistributedDataParallel' in str(w.message)]
    return {'warnings': ours, 'local': local, 'synced': record.grads[0], 'buckets': reduce.buckets}


class _Poison(Callback):
    """Puts a NaN into this rank's input at one batch of epoch 0."""

    def __init__(self, rank, batch):
        super().__init__()
        self.rank, self.batch = rank, batch

    def on_sample(self, state):
        if _rank() == self.rank and state[torchbearer.EPOCH] == 0 and state[torchbearer.BATCH] == self.batch:
            state[torchbearer.X] = state[torchbearer.X].clone()
            state[torchbearer.X][0, 0] = float('nan')


def _scenario_nonfinite_skip():
    torch.manual_seed(40)
    model = nn.Linear(4, 1)
    record = _Record()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[_Poison(1, 2), *distributed_callbacks(), record],
                      verbose=0)
        trial.with_train_generator(_loader(20)).run(1)
    return {'params': record.params, 'skipped': record.state['skipped']}


def _scenario_nonfinite_raise():
    torch.manual_seed(40)
    model = nn.Linear(4, 1)
    record = _Record()
    trial = Trial(model, _sgd(model), nn.MSELoss(),
                  callbacks=[_Poison(1, 2), *distributed_callbacks(on_nonfinite='raise'), record], verbose=0)
    with pytest.raises(RuntimeError, match=r'the averaged gradients hold NaN or Inf at epoch 0, batch 2 '
                                           r'\(on every rank\)'):
        trial.with_train_generator(_loader(20)).run(1)
    dist.barrier()
    return {'steps': record.steps, 'params': _snapshot(model)}


class _StopOnRank(Callback):
    """Sets STOP_TRAINING on one rank only: after a training step, or at an epoch end."""

    def __init__(self, rank, batch=None, epoch_end=None):
        super().__init__()
        self.rank, self.batch, self.epoch_end = rank, batch, epoch_end

    def on_step_training(self, state):
        if _rank() == self.rank and self.batch is not None and state[torchbearer.BATCH] == self.batch:
            state[torchbearer.STOP_TRAINING] = True

    def on_end_epoch(self, state):
        if _rank() == self.rank and state[torchbearer.EPOCH] == self.epoch_end:
            state[torchbearer.STOP_TRAINING] = True


def _scenario_stop():
    out = {}
    for name, stopper in (('step', _StopOnRank(1, batch=3)), ('epoch', _StopOnRank(1, epoch_end=0)),
                          ('step_after', _StopOnRank(1, batch=3))):
        torch.manual_seed(50)
        model = nn.Linear(4, 1)
        record = _Record()
        callbacks = [record, *distributed_callbacks(), stopper] if name == 'step_after' else [
            record, stopper, *distributed_callbacks()]
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=callbacks, verbose=0)
        history = trial.with_train_generator(_loader(32)).run(3)
        out[name] = {'steps': record.steps, 'epochs': len(history), 'params': _snapshot(model)}
    return out


def _uneven_loader():
    return _loader(20 + 4 * _rank())  # 5 batches on rank 0, 6 on rank 1


def _scenario_uneven_min():
    torch.manual_seed(60)
    model = nn.Linear(4, 1)
    record = _Record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[*distributed_callbacks(), CheckReplicas(every=1),
                                                                   record], verbose=0)
        trial.with_train_generator(_uneven_loader()).run(2)
    said = [str(w.message) for w in caught if 'unequal numbers of training batches' in str(w.message)]
    return {'steps': record.steps, 'params': _snapshot(model), 'warnings': said}


def _scenario_uneven_error():
    model = nn.Linear(4, 1)
    record = _Record()
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[*distributed_callbacks(uneven='error'), record],
                  verbose=0)
    with pytest.raises(ValueError, match=r'ranks have unequal numbers of training batches \(fewest 5, most 6; '
                                         r'this rank {}\)'.format(5 + _rank())):
        trial.with_train_generator(_uneven_loader()).run(1)
    dist.barrier()
    return {'steps': record.steps}


class _Tamper(Callback):
    """Changes one parameter on one rank only, after one step."""

    def on_step_training(self, state):
        if _rank() == 1 and state[torchbearer.BATCH] == 2:
            with torch.no_grad():
                state[torchbearer.MODEL][1].bias.add_(1.0)


def _scenario_check_replicas():
    torch.manual_seed(70)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    check, record = CheckReplicas(every=2), _Record()
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[_Tamper(), *distributed_callbacks(), record, check],
                  verbose=0)
    with pytest.raises(RuntimeError, match=r"replicas diverged: '1.bias' differs across ranks \(first of 1 "
                                           r"differing tensors\)"):
        trial.with_train_generator(_loader(40)).run(1)
    dist.barrier()
    return {'steps': record.steps}


class _RaiseAt(Callback):
    """Raises on every rank after a given training step."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_step_training(self, state):
        if state[torchbearer.BATCH] == self.batch:
            raise ValueError('planned failure at batch {}'.format(self.batch))


class _FailingForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError('planned failure in forward')
        return self.linear(x)


def _plain_backward_stays_local(model):
    """Rank 1 alone runs a backward: with live hooks it would start an all-reduce that no peer answers."""
    if _rank() == 1:
        model.zero_grad()
        x, y = next(iter(_loader(4)))
        nn.functional.mse_loss(model(x), y).backward()
        expected = _local_grads(model, _loader(4))
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.grad, expected[name]), name
    dist.barrier()


def _scenario_reuse():
    """One set of callbacks over several Trials in sequence, a run that raised, and a change of frozen layers."""
    callbacks = distributed_callbacks()
    out = {}
    for fold in range(2):  # k-fold: a new model and Trial per fold, the same callback objects
        torch.manual_seed(80 + fold + _rank())
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[*callbacks, _RaiseAt(2) if fold else Callback()],
                      verbose=0)
        if fold:
            with pytest.raises(ValueError, match='planned failure at batch 2'):
                trial.with_train_generator(_loader(16)).run(1)
            _plain_backward_stays_local(model)
            model[0].requires_grad_(False)  # the set of trained parameters changes between runs
            trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=callbacks, verbose=0)
        trial.with_train_generator(_loader(16)).run(2)
        out[fold] = _snapshot(model)
    _plain_backward_stays_local(model)  # after a run that ended normally
    # A run that raised inside forward, between the start of a step and its backward.
    torch.manual_seed(90)
    model = _FailingForward()
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=callbacks, verbose=0)
    try:
        trial.with_train_generator(_loader(16)).run(1)
    except Exception as error:  # torchbearer re-raises a forward's error wrapped in an Exception
        assert 'planned failure in forward' in str(error)
    _plain_backward_stays_local(model.linear)
    return out


class _WatchInputGrad(Callback):
    """From inside backward, when the input's gradient is computed (the last step of backward), look at the buckets."""

    def __init__(self, reduce):
        super().__init__()
        self.reduce, self.seen = reduce, []

    def on_sample(self, state):
        x = state[torchbearer.X].clone().requires_grad_()
        state[torchbearer.X] = x
        x.register_hook(self._look)

    def _look(self, grad):
        buckets = self.reduce.buckets.buckets
        self.seen.append([bucket.sent for bucket in buckets])


def _scenario_overlap_in_backward():
    """With overlap, the last layers' buckets are sent while backward still runs through the first layers."""
    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    # Buckets close after the tensor that fills them: [last layer], [middle layer], [first layer].
    reduce = AllReduceGradients(overlap=True, bucket_cap_mb=0.01, first_bucket_mb=0.0001)
    watch = _WatchInputGrad(reduce)
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[watch, BroadcastParameters(), reduce], verbose=0)
    trial.with_train_generator(_loader(12)).run(1)
    return {'seen': watch.seen, 'buckets': len(reduce.buckets.buckets)}


class _EvaluateAt(Callback):
    """Calls the Trial's evaluate() from inside a training step (a nested run of the callbacks)."""

    def on_step_training(self, state):
        if state[torchbearer.BATCH] == 1:
            state[torchbearer.SELF].evaluate()


def _scenario_nested_evaluate():
    out = []
    for nested in (False, True):
        torch.manual_seed(120 + _rank())
        model = nn.Linear(4, 1)
        extra = [_EvaluateAt()] if nested else []
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[*extra, *distributed_callbacks()], verbose=0)
        trial.with_generators(_loader(16), _loader(8)).run(2)
        out.append(_snapshot(model))
    return out


SCENARIOS = {
    'broadcast': lambda: _scenario_broadcast('broadcast'),
    'p2p': lambda: _scenario_broadcast('p2p'),
    'mismatch': _scenario_mismatch,
    'unused_and_frozen': _scenario_unused_and_frozen,
    'ddp_model': _scenario_ddp_model,
    'nonfinite_skip': _scenario_nonfinite_skip,
    'nonfinite_raise': _scenario_nonfinite_raise,
    'stop': _scenario_stop,
    'uneven_min': _scenario_uneven_min,
    'uneven_error': _scenario_uneven_error,
    'check_replicas': _scenario_check_replicas,
    'reuse': _scenario_reuse,
    'overlap_in_backward': _scenario_overlap_in_backward,
    'nested_evaluate': _scenario_nested_evaluate,
}


def _worker_scenarios():
    torch.set_num_threads(1)
    return run_in_step(SCENARIOS.items())


@pytest.fixture(scope='module')
def scenarios():
    return run_workers(_worker_scenarios, 2, deadline=90)


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), '{} differs: {} vs {}'.format(name, a[name], b[name])


@pytest.mark.slow
@pytest.mark.parametrize('method', ['broadcast', 'p2p'])
def test_broadcast_makes_replicas_identical_buffers_included(scenarios, method):
    rank0, rank1 = scenario_values(scenarios, method)
    assert not torch.equal(rank0['before']['0.weight'], rank1['before']['0.weight'])
    assert rank1['before']['1.num_batches_tracked'].item() == 8
    _assert_equal(rank1['built'], rank1['before'])
    _assert_equal(rank0['after'], rank0['before'])  # copied from rank 0, never averaged
    _assert_equal(rank1['after'], rank0['before'])
    assert rank1['after']['1.num_batches_tracked'].item() == 7


@pytest.mark.slow
def test_model_mismatch_fails_every_rank_naming_the_entry(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'mismatch')
    assert rank0 == rank1  # every rank reports the same root cause


@pytest.mark.slow
def test_gradient_unused_on_one_rank_is_averaged_with_zeros(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'unused_and_frozen')
    for name in ('shared.weight', 'shared.bias', 'branch.weight', 'branch.bias'):
        locals_ = [r['local'][name] for r in (rank0, rank1)]
        zero = torch.zeros_like(next(g for g in locals_ if g is not None))
        expected = sum(zero if g is None else g for g in locals_) / 2
        assert torch.equal(rank0['synced'][name], rank1['synced'][name]), name
        torch.testing.assert_close(rank0['synced'][name], expected)
    assert rank0['local']['branch.weight'] is None and rank1['local']['branch.weight'] is not None
    for rank in (rank0, rank1):
        assert rank['synced']['unused.weight'] is None and rank['synced']['unused.bias'] is None


@pytest.mark.slow
def test_frozen_parameters_are_untouched_and_not_communicated(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'unused_and_frozen')
    for rank in (rank0, rank1):
        assert rank['synced']['frozen.weight'] is None
        _assert_equal(rank['frozen_after'], rank['frozen_before'])
        assert rank['communicated'] == ['branch.bias', 'branch.weight', 'shared.bias', 'shared.weight',
                                        'unused.bias', 'unused.weight']
    _assert_equal(rank0['frozen_after'], rank1['frozen_after'])


@pytest.mark.slow
def test_ddp_model_warns_once_and_gradients_are_left_to_ddp(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'ddp_model')
    for rank in (rank0, rank1):
        assert len(rank['warnings']) == 1, rank['warnings']
        assert rank['buckets'] is None
    for name in ('weight', 'bias'):
        expected = (rank0['local'][name] + rank1['local'][name]) / 2  # averaged once, by DDP
        torch.testing.assert_close(rank0['synced'][name], expected)
        torch.testing.assert_close(rank1['synced'][name], expected)


@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_both(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'nonfinite_skip')
    assert rank0['skipped'] == rank1['skipped'] == 1
    assert len(rank0['params']) == len(rank1['params']) == 5
    for step in range(5):
        _assert_equal(rank0['params'][step], rank1['params'][step])
    _assert_equal(rank0['params'][2], rank0['params'][1])  # batch 2 was skipped
    assert not torch.equal(rank0['params'][3]['weight'], rank0['params'][2]['weight'])


@pytest.mark.slow
def test_nonfinite_gradient_with_raise_stops_both_ranks(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'nonfinite_raise')
    assert rank0['steps'] == rank1['steps'] == {0: 2}
    _assert_equal(rank0['params'], rank1['params'])


@pytest.mark.slow
def test_stop_on_one_rank_stops_both_at_the_same_step(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'stop')
    # Set after batch 3 on rank 1: it travels with the next step's gradients; both stop after batch 4.
    assert rank0['step']['steps'] == rank1['step']['steps'] == {0: 5}
    _assert_equal(rank0['step']['params'], rank1['step']['params'])
    # The same stop from a callback placed after ours: the agreement still sees it.
    assert rank0['step_after']['steps'] == rank1['step_after']['steps'] == {0: 5}
    _assert_equal(rank0['step_after']['params'], rank0['step']['params'])
    # Set at the end of epoch 0 on rank 1: both end after that epoch.
    assert rank0['epoch']['epochs'] == rank1['epoch']['epochs'] == 1
    assert rank0['epoch']['steps'] == rank1['epoch']['steps'] == {0: 8}
    _assert_equal(rank0['epoch']['params'], rank1['epoch']['params'])


@pytest.mark.slow
def test_uneven_batches_stop_at_the_shortest(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'uneven_min')
    assert rank0['steps'] == rank1['steps'] == {0: 5, 1: 5}
    _assert_equal(rank0['params'], rank1['params'])
    assert rank0['warnings'] == ['ranks have unequal numbers of training batches (fewest 5, most 6): every rank '
                                 'stops after 5 this epoch']
    assert rank1['warnings'] == []


@pytest.mark.slow
def test_uneven_batches_with_error_policy_raise_before_step_one(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'uneven_error')
    assert rank0['steps'] == rank1['steps'] == {}


@pytest.mark.slow
def test_check_replicas_names_a_parameter_changed_on_one_rank(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'check_replicas')
    assert rank0['steps'] == rank1['steps'] == {0: 4}  # changed after step 3, found at the check after step 4


def _reference_reuse():
    """The reuse scenario in one process at the global batch (batch i of rank 0 and of rank 1 together, 8
    samples): the weights each fold must end with, and those it started from (rank 0's, as broadcast)."""
    ranks = [list(_loader(16, rank=rank)) for rank in range(2)]
    batches = [(torch.cat([x0, x1]), torch.cat([y0, y1])) for (x0, y0), (x1, y1) in zip(*ranks)]
    initial, trained = {}, {}
    for fold in range(2):
        torch.manual_seed(80 + fold)  # rank 0's seed
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
        initial[fold] = _snapshot(model)
        # fold 1: one epoch that raises after the step of batch 2, then layer 0 frozen; each fold: two epochs
        runs = [(1, batches[:3]), (2, batches)] if fold else [(2, batches)]
        for number, (epochs, run) in enumerate(runs):
            if fold and number == 1:
                model[0].requires_grad_(False)
            optimizer = _sgd(model)
            for _ in range(epochs):
                for x, y in run:
                    optimizer.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
        trained[fold] = _snapshot(model)
    return initial, trained


@pytest.mark.slow
def test_callbacks_serve_several_trials_a_failed_run_and_new_frozen_layers(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'reuse')
    initial, reference = _reference_reuse()
    for fold in (0, 1):
        _assert_equal(rank0[fold], rank1[fold])
        torch.testing.assert_close(rank0[fold], reference[fold], msg=lambda text, fold=fold: 'fold {}: {}'.format(
            fold, text))
        moved = {name: (reference[fold][name] - initial[fold][name]).abs().max().item() for name in initial[fold]}
        assert min(moved.values()) > 1e-3, moved  # every tensor trained (layer 0 of fold 1 before it was frozen)


@pytest.mark.slow
def test_evaluate_nested_in_a_run_leaves_the_run_synchronized(scenarios):
    rank0, rank1 = scenario_values(scenarios, 'nested_evaluate')
    plain, nested = rank0
    _assert_equal(nested, rank1[1])
    _assert_equal(nested, plain)


@pytest.mark.slow
def test_overlap_sends_late_buckets_before_backward_ends(scenarios):
    for rank in scenario_values(scenarios, 'overlap_in_backward'):
        assert rank['buckets'] >= 3
        assert len(rank['seen']) == 3  # one look per step, from inside each backward
        for sent in rank['seen']:
            assert sent[0] and sent[1], sent  # the last layers' buckets were already on the wire
            assert not sent[-1], sent  # the first layer's bucket waits for its gradient


def _worker_late_group(path):
    """The Trial is built before the process group exists, as the shared-file snippet invites."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    dist.destroy_process_group()
    torch.manual_seed(110 + rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=distributed_callbacks(), verbose=1)
    dist.init_process_group('gloo', init_method='file://' + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    err = io.StringIO()
    with redirect_stderr(err):
        trial.with_train_generator(_loader(8)).run(1)
    return {'params': _snapshot(model), 'err': err.getvalue()}


@pytest.mark.slow
def test_trial_built_before_the_process_group_is_broadcast_at_its_first_epoch(tmp_path):
    rank0, rank1 = run_workers(_worker_late_group, 2, args=(str(tmp_path / 'store'),))
    _assert_equal(rank0['params'], rank1['params'])
    # The rank-0 output decision is made then too. The bar that run injected for the Trial's verbose=1
    # drew its 0% line on rank 1 before any callback's on_start: that line is erased.
    assert '1/1' not in rank1['err'] and '1/1' in rank0['err']
    assert rank1['err'].rsplit('\r', 1)[-1].strip() == ''


class _ShapeCheck(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 2)
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.linear(x)


def test_flatten_images_in_training_validation_test_and_predict():
    torch.set_num_threads(1)
    images, targets = torch.randn(6, 3, 2, 2), torch.randn(6, 2)
    loader = DataLoader(TensorDataset(images, targets), batch_size=3)
    model = _ShapeCheck()
    trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=[FlattenImages()], verbose=0)
    trial.with_generators(train_generator=loader, val_generator=loader, test_generator=loader)
    trial.run(1)
    assert len(model.shapes) == 4
    trial.evaluate(data_key=torchbearer.TEST_DATA)
    assert len(model.shapes) == 6
    predictions = trial.predict()
    assert model.shapes == [(3, 12)] * 8
    assert tuple(predictions.shape) == (6, 2)


def test_callbacks_are_inert_in_a_job_of_one():
    """Without a process group, the same Trial trains exactly as it does without the callbacks."""
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 1)
    results = []
    for callbacks in ([*distributed_callbacks(), CheckReplicas(1), EvenBatches('error')], []):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        before = _snapshot(model)
        trial = Trial(model, _sgd(model), nn.MSELoss(), callbacks=callbacks, verbose=0)
        trial.with_train_generator(DataLoader(TensorDataset(x, y), batch_size=4)).run(2)
        assert not torch.equal(model.weight, before['weight'])  # it trained
        results.append(_snapshot(model))
    _assert_equal(*results)


def test_the_callbacks_that_carry_a_stop_offer_the_declared_protocol():
    """AllReduceGradients and DiLoCo carry a stop request in their own collectives, as stop.StopCarrier declares;
    AgreeOnStop carries none of its own (its DDP companion, an AllReduceGradients, does)."""
    from torchbearer_dist.callbacks.stop import StopCarrier
    assert isinstance(AllReduceGradients(), StopCarrier) and isinstance(torchbearer_dist.DiLoCo(), StopCarrier)
    assert not isinstance(torchbearer_dist.AgreeOnStop(), StopCarrier)
