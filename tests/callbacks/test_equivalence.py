"""2 ranks at batch B train exactly like one process at batch 2B, and like torch DDP.

Every configuration trains in one launch of two ranks (a spawn costs seconds on a small machine);
each test then checks its own configuration. The ranks start from differently seeded models, so
BroadcastParameters is part of what is checked: rank 0 is seeded like the single-process reference.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer.callbacks import GradientNormClipping

import torchbearer_dist

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 10
EPOCHS = 2  # 20 optimizer steps
N = 2 * B * STEPS
LR = 0.1
MOMENTUM = 0.9
SEED = 100


def _data():
    generator = torch.Generator().manual_seed(123)
    return torch.randn(N, 6, generator=generator), torch.randint(0, 3, (N,), generator=generator)


class _TwoDtypes(nn.Module):
    """A float64 layer feeding a float32 one: gradients travel in two dtype buckets."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 8).double()
        self.second = nn.Linear(8, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x.double())).float())


def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == 'mlp':
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if kind == 'bn':
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return _TwoDtypes()


class _Accumulate:
    """Gradient accumulation: steps (and zeroes gradients) only on every k-th call of ``step``."""

    def __init__(self, optimizer, k):
        self.optimizer, self.k, self.calls = optimizer, k, 0

    def zero_grad(self, set_to_none=True):
        pass  # the Trial's closure calls this every step; gradients must accumulate instead

    def step(self, closure):
        loss = closure()
        self.calls += 1
        if self.calls % self.k == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss

    def state_dict(self):
        return self.optimizer.state_dict()


def _snapshot(model):
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


CLIP = 0.05  # small enough to clip every step


def _reference(kind, accumulate=1, clip=False):
    """One process, batch 2B, the same samples in the same order: the result 2 ranks must reproduce."""
    x, y = _data()
    model = _model(kind, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    calls = 0
    for _ in range(EPOCHS):
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=2 * B):
            nn.functional.cross_entropy(model(xb), yb).backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            calls += 1
            if calls % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
    return _snapshot(model)


def _train_trial(kind, options):
    """One rank of the Trial under test: the union of both ranks' batch i is the reference's batch i."""
    rank = dist.get_rank()
    model = _model(kind, SEED + rank)
    dataset = TensorDataset(*_data())
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    options = dict(options)
    clip, closure = options.pop('clip', False), options.pop('closure', False)
    accumulate = options.get('sync_every', 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if accumulate > 1:
        optimizer = _Accumulate(optimizer, accumulate)
    callbacks = torchbearer_dist.distributed_callbacks(**options)
    if clip:  # before ours, or after them (clip='last'): either way it must clip the averaged gradient
        clipping = GradientNormClipping(CLIP, params=list(model.parameters()))
        callbacks.insert(len(callbacks) if clip == 'last' else 0, clipping)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'], callbacks=callbacks,
                              verbose=0)
    if closure:
        trial.with_closure(_plain_closure)
    trial.with_train_generator(loader)
    trial.run(EPOCHS)
    buckets = next(c for c in callbacks if isinstance(c, torchbearer_dist.AllReduceGradients)).buckets
    return {'state': _snapshot(model), 'buckets': len(buckets.buckets)}


def _plain_closure(state):
    """A custom closure that calls no callback at all: the gradients must still be averaged."""
    state[torchbearer.OPTIMIZER].zero_grad()
    loss = nn.functional.cross_entropy(state[torchbearer.MODEL](state[torchbearer.X]), state[torchbearer.Y_TRUE])
    state[torchbearer.Y_PRED], state[torchbearer.LOSS] = None, loss
    loss.backward()


def _train_ddp(kind):
    """One rank of torch's own DistributedDataParallel in a plain loop, the other reference."""
    rank = dist.get_rank()
    model = _model(kind, SEED + rank)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers
    dataset = TensorDataset(*_data())
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(EPOCHS):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(xb), yb).backward()
            optimizer.step()
    return {'state': _snapshot(model)}


CONFIGS = {
    'plain': ('trial', 'mlp', {}),
    'dtypes': ('trial', 'dtypes', {}),
    'bn': ('trial', 'bn', {}),
    'fp16': ('trial', 'mlp', {'compression': 'fp16'}),
    'bf16': ('trial', 'mlp', {'compression': 'bf16'}),
    'many_buckets': ('trial', 'mlp', {'bucket_cap_mb': 1e-5, 'first_bucket_mb': 1e-5}),
    'one_bucket': ('trial', 'mlp', {'bucket_cap_mb': 25.0, 'first_bucket_mb': 25.0}),
    'sync_every': ('trial', 'mlp', {'sync_every': 2}),
    'clip_first': ('trial', 'mlp', {'clip': True}),
    'clip_first_overlap': ('trial', 'mlp', {'clip': True, 'overlap': True}),
    'clip_last': ('trial', 'mlp', {'clip': 'last'}),
    'clip_last_overlap': ('trial', 'mlp', {'clip': 'last', 'overlap': True}),
    'closure': ('trial', 'mlp', {'closure': True}),
    'closure_overlap': ('trial', 'mlp', {'closure': True, 'overlap': True}),
    'ddp': ('ddp', 'mlp', None),
    'ddp_bn': ('ddp', 'bn', None),
}


def _run_config(name):
    how, kind, options = CONFIGS[name]
    return _train_trial(kind, options) if how == 'trial' else _train_ddp(kind)


def _worker_train_all():
    torch.set_num_threads(1)
    return run_in_step((name, functools.partial(_run_config, name)) for name in sorted(CONFIGS))


@pytest.fixture(scope='module')
def trained():
    return run_workers(_worker_train_all, 2, deadline=90)


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), 'entry {} differs: {} vs {}'.format(name, a[name], b[name])


def _assert_close(actual, expected, **tolerance):
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: '{}: {}'.format(n, m),
                                   **tolerance)


def _params(state):
    return {k: v for k, v in state.items() if 'running' not in k and 'num_batches' not in k}


@pytest.mark.slow
def test_two_ranks_match_one_process_at_twice_the_batch(trained):
    rank0, rank1 = scenario_values(trained, 'plain')
    _assert_equal(rank0['state'], rank1['state'])
    reference = _reference('mlp')
    _assert_close(rank0['state'], reference, rtol=1e-5, atol=1e-6)
    initial = _snapshot(_model('mlp', SEED))
    assert not torch.equal(reference['0.weight'], initial['0.weight'])  # it did train


@pytest.mark.slow
def test_two_ranks_match_torch_ddp(trained):
    rank0, rank1 = scenario_values(trained, 'plain')
    ddp0, ddp1 = scenario_values(trained, 'ddp')
    _assert_equal(ddp0['state'], ddp1['state'])
    _assert_close(rank0['state'], ddp0['state'], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_parameters_of_several_dtypes(trained):
    rank0, rank1 = scenario_values(trained, 'dtypes')
    _assert_equal(rank0['state'], rank1['state'])
    assert rank0['buckets'] == 2  # one bucket per dtype
    reference = _reference('dtypes')
    assert reference['first.weight'].dtype == torch.float64
    _assert_close(rank0['state'], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_batchnorm_model_matches_ddp(trained):
    rank0, rank1 = scenario_values(trained, 'bn')
    ddp0, _ = scenario_values(trained, 'ddp_bn')
    _assert_equal(rank0['state'], rank1['state'])  # rank 0's running statistics are copied at each epoch end
    _assert_close(_params(rank0['state']), _params(ddp0['state']), rtol=1e-5, atol=1e-6)
    # Rank 0's running statistics come from rank 0's batches alone, under DDP as here.
    _assert_close(rank0['state'], ddp0['state'], rtol=1e-5, atol=1e-6)
    assert rank0['state']['1.num_batches_tracked'].item() == EPOCHS * STEPS


@pytest.mark.slow
@pytest.mark.parametrize('compression, atol', [('fp16', 2e-3), ('bf16', 2e-2)])
def test_compressed_gradients_stay_close(trained, compression, atol):
    rank0, rank1 = scenario_values(trained, compression)
    _assert_equal(rank0['state'], rank1['state'])
    exact, _ = scenario_values(trained, 'plain')
    _assert_close(rank0['state'], exact['state'], rtol=1e-2, atol=atol)


@pytest.mark.slow
def test_many_small_buckets_equal_one_bucket(trained):
    many0, many1 = scenario_values(trained, 'many_buckets')
    one0, _ = scenario_values(trained, 'one_bucket')
    assert many0['buckets'] == 4 and one0['buckets'] == 1
    _assert_equal(many0['state'], many1['state'])
    _assert_equal(many0['state'], one0['state'])


@pytest.mark.slow
def test_sync_every_accumulates_locally_then_averages(trained):
    rank0, rank1 = scenario_values(trained, 'sync_every')
    _assert_equal(rank0['state'], rank1['state'])
    _assert_close(rank0['state'], _reference('mlp', accumulate=2), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('config', ['clip_first', 'clip_first_overlap', 'clip_last', 'clip_last_overlap'])
def test_clipping_placed_before_or_after_ours_clips_the_averaged_gradient(trained, config):
    rank0, rank1 = scenario_values(trained, config)
    _assert_equal(rank0['state'], rank1['state'])
    reference = _reference('mlp', clip=True)
    _assert_close(rank0['state'], reference, rtol=1e-5, atol=1e-6)
    assert (rank0['state']['0.weight'] - _reference('mlp')['0.weight']).abs().max() > 1e-3  # clipping mattered


@pytest.mark.slow
@pytest.mark.parametrize('config', ['closure', 'closure_overlap'])
def test_custom_closure_without_callbacks_is_averaged(trained, config):
    rank0, rank1 = scenario_values(trained, config)
    _assert_equal(rank0['state'], rank1['state'])
    _assert_close(rank0['state'], _reference('mlp'), rtol=1e-5, atol=1e-6)


def test_world_of_one_with_callbacks_equals_the_reference():
    """The callbacks do nothing in a job of one: a Trial at batch 2B with them equals the reference."""
    torch.set_num_threads(1)
    x, y = _data()
    model = _model('mlp', SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'],
                              callbacks=torchbearer_dist.distributed_callbacks(), verbose=0)
    trial.with_train_generator(DataLoader(TensorDataset(x, y), batch_size=2 * B))
    trial.run(EPOCHS)
    _assert_close(_snapshot(model), _reference('mlp'), rtol=1e-6, atol=1e-7)
