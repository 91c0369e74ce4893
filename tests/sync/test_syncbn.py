"""convert_sync_batchnorm: 2 ranks at batch B train like one process at 2B with plain BatchNorm.

Every scenario runs in one launch of two real gloo ranks. The ranks build their models from
different seeds (BroadcastParameters makes rank 0's win; rank 0 is seeded like the reference).
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchbearer_dist
from torchbearer_dist.sync.syncbn import SyncBatchNorm, convert_sync_batchnorm

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 5
EPOCHS = 2
N = 2 * B * STEPS
LR = 0.1
SEED = 7
#: Reference batches of the uneven scenario, and how many of each go to rank 0 (the rest to rank 1).
UNEVEN_SIZES = (8, 8, 8, 5, 3)
UNEVEN_RANK0 = (4, 3, 6, 5, 1)


def _data(kind):
    generator = torch.Generator().manual_seed(11)
    shape = (N, 6) if kind == '1d' else (N, 2, 5, 5)
    return torch.randn(*shape, generator=generator) * 2 + 1, torch.randint(0, 3, (N,), generator=generator)


def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == '1d':  # momentum=None (cumulative average) and affine=False in the second layer
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                             nn.BatchNorm1d(8, momentum=None, affine=False), nn.Tanh(), nn.Linear(8, 3))
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))


def _snapshot(model):
    state = torchbearer_dist.sync.models.unwrap(model).state_dict()
    return {name: value.detach().clone() for name, value in state.items()}


def _sum_loss(scale):
    return lambda y_pred, y: nn.functional.cross_entropy(y_pred, y, reduction='sum') / scale


def _reference(kind, batches=None):
    """One process, plain BatchNorm, batches of 2B: what 2 converted ranks must reproduce."""
    x, y = _data(kind)
    model = _model(kind, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if batches is None:
        batches = [(x[i:i + 2 * B], y[i:i + 2 * B]) for i in range(0, N, 2 * B)]
    loss = _sum_loss(2 * B)
    for _ in range(EPOCHS):
        for xb, yb in batches:
            optimizer.zero_grad()
            loss(model(xb), yb).backward()
            optimizer.step()
    return _snapshot(model)


def _uneven_batches(x, y, rank=None):
    """The reference's uneven batches, or this rank's share of each (rank 0 takes the first ones)."""
    batches, start = [], 0
    for size, first in zip(UNEVEN_SIZES, UNEVEN_RANK0):
        lo, hi = (start, start + size) if rank is None else \
            (start, start + first) if rank == 0 else (start + first, start + size)
        batches.append((x[lo:hi], y[lo:hi]))
        start += size
    return batches


def _train(kind, convert=True, how='callbacks', uneven=False):
    rank = dist.get_rank()
    model = _model(kind, SEED + rank)
    if convert:
        model = convert_sync_batchnorm(model)
    if how == 'ddp':
        model = torchbearer_dist.wrap_ddp(model, device='cpu')
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data(kind)
    if uneven:
        generator = _uneven_batches(x, y, rank)
    else:
        dataset = TensorDataset(x, y)
        generator = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    # Each rank sums its samples' losses over the nominal B: averaged over 2 ranks, that is the
    # reference's sum over 2B whatever the split of a batch.
    trial = torchbearer.Trial(model, optimizer, _sum_loss(B), metrics=['loss'], verbose=0,
                              callbacks=torchbearer_dist.distributed_callbacks(ddp=how == 'ddp'))
    trial.with_train_generator(generator)
    trial.run(EPOCHS)
    return _snapshot(model)


def _eval_on_rank0_only():
    """Eval mode must not communicate: rank 0 runs a forward that rank 1 never joins."""
    model = convert_sync_batchnorm(_model('2d', SEED))
    plain = _model('2d', SEED)
    x = _data('2d')[0][:5]
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].running_var.uniform_(0.5, 2)
    plain.load_state_dict(model.state_dict())
    model.eval()
    plain.eval()
    if dist.get_rank() == 0:
        out = model(x)  # a collective here would wait for rank 1 until the timeout and raise
        torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    return True


def _count_all_reduces():
    """All-reduces of one training step and of one eval forward, as torch's profiler sees them."""
    model = convert_sync_batchnorm(_model('1d', SEED))
    x = _data('1d')[0][:B]
    counts = []
    for train in (True, False):
        model.train(train)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = model(x)
            if train:
                out.sum().backward()
        counts.append(sum(event.name == 'c10d::allreduce_' for event in prof.events()))
    return counts


SCENARIOS = {
    'collectives': _count_all_reduces,
    'bn1d': functools.partial(_train, '1d'),
    'bn2d': functools.partial(_train, '2d'),
    'plain_bn1d': functools.partial(_train, '1d', convert=False),
    'uneven': functools.partial(_train, '1d', uneven=True),
    'ddp_cpu': functools.partial(_train, '2d', how='ddp'),
    'eval': _eval_on_rank0_only,
}


def _worker_all():
    torch.set_num_threads(1)
    return run_in_step(sorted(SCENARIOS.items()))


@pytest.fixture(scope='module')
def trained():
    return run_workers(_worker_all, 2, deadline=120)


def _max_diffs(actual, expected):
    """Largest absolute difference per kind of entry: parameters, running_mean, running_var, num_batches_tracked."""
    assert actual.keys() == expected.keys()
    kinds = {}
    for name in actual:
        kind = name.rsplit('.', 1)[1]
        kind = kind if kind in ('running_mean', 'running_var', 'num_batches_tracked') else 'parameters'
        diff = (actual[name].double() - expected[name].double()).abs().max().item()
        kinds[kind] = max(kinds.get(kind, 0.0), diff)
    return kinds


def _assert_matches(actual, expected):
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5,
                                   msg=lambda m, n=name: '{}: {}'.format(n, m))


@pytest.mark.slow
@pytest.mark.parametrize('scenario,kind', [('bn1d', '1d'), ('bn2d', '2d'), ('ddp_cpu', '2d')])
def test_two_ranks_match_one_process_at_twice_the_batch(trained, scenario, kind):
    rank0, rank1 = scenario_values(trained, scenario)
    reference = _reference(kind)
    _assert_matches(rank0, reference)
    _assert_matches(rank1, reference)
    assert int(rank0['1.num_batches_tracked']) == EPOCHS * STEPS
    assert not torch.equal(reference['1.running_mean'], torch.zeros_like(reference['1.running_mean']))


@pytest.mark.slow
def test_plain_batchnorm_on_two_ranks_does_not_match(trained):
    """The comparison above can fail: unsynchronized BatchNorm ends far from the reference."""
    rank0, _ = scenario_values(trained, 'plain_bn1d')
    diffs = _max_diffs(rank0, _reference('1d'))
    assert diffs['parameters'] > 1e-3 and diffs['running_var'] > 1e-3, diffs


@pytest.mark.slow
def test_uneven_batches_and_a_rank_with_no_samples(trained):
    rank0, rank1 = scenario_values(trained, 'uneven')
    reference = _reference('1d', _uneven_batches(*_data('1d')))
    _assert_matches(rank0, reference)
    _assert_matches(rank1, reference)


@pytest.mark.slow
def test_one_small_all_reduce_per_layer_each_way(trained):
    # two BatchNorm layers: one all-reduce each in forward and in backward; none in eval mode
    assert scenario_values(trained, 'collectives') == [[4, 0], [4, 0]]


@pytest.mark.slow
def test_eval_mode_communicates_nothing(trained):
    assert scenario_values(trained, 'eval') == [True, True]


def test_conversion_keeps_parameters_buffers_and_options():
    model = nn.Sequential(nn.BatchNorm1d(3, eps=1e-3, momentum=None), nn.Sequential(nn.BatchNorm2d(4, affine=False)),
                          nn.BatchNorm3d(2, track_running_stats=False))
    model[2].eval()
    before = [list(layer.parameters()) + list(layer.buffers()) for layer in (model[0], model[1][0], model[2])]
    converted = convert_sync_batchnorm(model)
    layers = (converted[0], converted[1][0], converted[2])
    assert converted is model and all(isinstance(layer, SyncBatchNorm) for layer in layers)
    for layer, tensors in zip(layers, before):
        assert all(a is b for a, b in zip(list(layer.parameters()) + list(layer.buffers()), tensors))
    assert (layers[0].eps, layers[0].momentum, layers[0].affine) == (1e-3, None, True)
    assert layers[1].weight is None and layers[1].running_mean is not None
    assert layers[2].running_mean is None and not layers[2].training and layers[0].training
    single = convert_sync_batchnorm(nn.BatchNorm1d(5))
    assert isinstance(single, SyncBatchNorm) and single.num_features == 5


def test_state_dict_round_trip():
    plain = _model('1d', SEED)
    plain(torch.randn(10, 6))  # running statistics that are not the initial ones
    converted = convert_sync_batchnorm(_model('1d', SEED + 1))
    converted.load_state_dict(plain.state_dict())
    back = _model('1d', SEED + 2)
    back.load_state_dict(converted.state_dict())
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_job_of_one_is_plain_batchnorm():
    x = torch.randn(6, 4, 3)
    plain = nn.BatchNorm1d(4)
    converted = convert_sync_batchnorm(nn.BatchNorm1d(4))
    out_plain, out_converted = plain(x.requires_grad_()), converted(x)
    torch.testing.assert_close(out_converted, out_plain, rtol=0, atol=0)
    torch.testing.assert_close(converted.state_dict(), plain.state_dict(), rtol=0, atol=0)


def test_bad_input():
    with pytest.raises(ValueError, match=r"module should be a torch.nn.Module, but given 'int'"):
        convert_sync_batchnorm(3)
    with pytest.raises(ValueError, match=r'expected at least 2D input \(got 1D input\)'):
        convert_sync_batchnorm(nn.BatchNorm1d(3))(torch.randn(3))


def _worker_cuda():
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    model = convert_sync_batchnorm(_model('2d', SEED)).cuda()
    x = _data('2d')[0][:2 * B].cuda()
    out = model(x[rank * B:(rank + 1) * B])
    out.sum().backward()
    return _snapshot(model)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')
def test_cuda_nccl_delegates_to_torch():
    rank0, rank1 = run_workers(_worker_cuda, 2, backend='nccl', deadline=120)
    plain = _model('2d', SEED)
    plain(_data('2d')[0][:2 * B])
    for name in ('1.running_mean', '1.running_var'):
        torch.testing.assert_close(rank0[name].cpu(), plain.state_dict()[name], rtol=0, atol=1e-5)
        torch.testing.assert_close(rank1[name].cpu(), plain.state_dict()[name], rtol=0, atol=1e-5)
