"""The GPU path: nccl DDP through wrap_ddp, and two gloo ranks sharing one GPU against one process at 2B.

The tests marked ``gpu`` skip without CUDA (``TORCHBEARER_DIST_TEST_GPU=1`` turns that skip into a
failure, see conftest.py); those needing two GPUs skip on a one-GPU machine. The one-GPU tests
(two gloo ranks both on ``cuda:0``: AllReduceGradients, the DDP path, SyncBatchNorm, and a CUDA
checkpoint resumed on a CPU-only process) train where ``TORCHBEARER_DIST_TEST_DEVICE`` says,
``cuda`` by default. Set it to ``cpu`` to check their bodies on a machine without a GPU: they are then
marked ``slow`` instead of ``gpu``, so nothing skips them::

    TORCHBEARER_DIST_TEST_DEVICE=cpu python -m pytest -n 0 tests/e2e/test_gpu.py

Every comparison runs in float32 with TF32 off, against the reference the CPU tests use
(tests/callbacks/test_equivalence.py, tests/sync/test_syncbn.py: their data, models and constants).
"""
import functools
import os
import re
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial

import torchbearer_dist

from _dist import (  # noqa: I001
    ON_GPU,
    ONE_DEVICE,
    ROOT,
    child_env,
    run_command,
    run_in_step,
    run_workers,
    scenario_values,
    world_of_one,
)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in ('callbacks', 'sync'):  # the CPU tests' helpers, under the names pytest imports them by
    if os.path.join(TESTS, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(TESTS, _folder))
import test_equivalence as equivalence  # noqa: E402
import test_syncbn as syncbn  # noqa: E402

#: Largest parameter difference from the one-process reference, float32 without TF32.
TOLERANCE = 1e-5


def _device():
    return torch.device('cuda', 0) if ON_GPU else torch.device('cpu')


def _exact_float32():
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _cpu(state):
    return {name: value.detach().cpu().clone() for name, value in state.items()}


def _max_difference(actual, expected):
    assert actual.keys() == expected.keys()
    return max((actual[k].double() - expected[k].double()).abs().max().item() for k in actual)


# -- the nccl DDP path ------------------------------------------------------------------------------

def _worker_ddp_trial():
    torch.set_num_threads(1)
    torch.manual_seed(dist.get_rank())  # replicas start apart: DDP broadcasts rank 0's weights
    model = torchbearer_dist.wrap_ddp(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=torchbearer_dist.distributed_callbacks(ddp=True), verbose=0).to(model.device)
    initial = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    history = trial.with_train_generator(loader).run(2)
    return {'backend': dist.get_backend(), 'device': str(model.device), 'history': history, 'initial': initial,
            'params': {k: v.detach().cpu() for k, v in model.module.state_dict().items()}}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason='needs 1 GPU')
def test_one_rank_nccl_ddp_trains_in_a_trial():
    (result,) = run_workers(_worker_ddp_trial, 1, backend='nccl', deadline=120)
    assert result['backend'] == 'nccl' and result['device'] == 'cuda:0'
    history = result['history']
    assert len(history) == 2 and history[1]['loss'] < history[0]['loss'], history  # it trained: the loss fell
    for name, value in result['params'].items():
        assert not torch.equal(value, result['initial'][name]), '{} never changed'.format(name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')
def test_two_ranks_nccl_ddp_end_with_identical_parameters():
    rank0, rank1 = run_workers(_worker_ddp_trial, 2, backend='nccl', deadline=120)
    assert rank0['device'] == 'cuda:0' and rank1['device'] == 'cuda:1'
    assert rank0['history'] == rank1['history']
    for name in rank0['params']:
        assert torch.equal(rank0['params'][name], rank1['params'][name]), name


# -- two gloo ranks sharing one GPU ----------------------------------------------------------------

def _reference_on(device):
    """test_equivalence's reference (one process, batch 2B, the same samples in order) on ``device``."""
    x, y = (t.to(device) for t in equivalence._data())
    model = equivalence._model('mlp', equivalence.SEED).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=equivalence.LR, momentum=equivalence.MOMENTUM)
    for _ in range(equivalence.EPOCHS):
        for start in range(0, len(x), 2 * equivalence.B):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[start:start + 2 * equivalence.B]),
                                        y[start:start + 2 * equivalence.B]).backward()
            optimizer.step()
    return _cpu(model.state_dict())


def _rank_trial(model, ddp):
    """This rank's Trial on the device, batch B of test_equivalence's data (the union of both is the reference's)."""
    dataset = TensorDataset(*equivalence._data())
    loader = DataLoader(dataset, batch_size=equivalence.B, sampler=DistributedSampler(dataset, shuffle=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=equivalence.LR, momentum=equivalence.MOMENTUM)
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'],
                  callbacks=torchbearer_dist.distributed_callbacks(ddp=ddp), verbose=0).to(_device())
    trial.with_train_generator(loader).run(equivalence.EPOCHS)


def _scenario_allreduce():
    """distributed_callbacks() (AllReduceGradients) with the model and batches on the device."""
    model = equivalence._model('mlp', equivalence.SEED + dist.get_rank()).to(_device())
    _rank_trial(model, ddp=False)
    return {'device': str(next(model.parameters()).device), 'state': _cpu(model.state_dict())}


def _scenario_ddp():
    """distributed_callbacks(ddp=True) with wrap_ddp: both ranks on the one device, over gloo."""
    model = torchbearer_dist.wrap_ddp(equivalence._model('mlp', equivalence.SEED + dist.get_rank()),
                                      device=_device())
    _rank_trial(model, ddp=True)
    return {'device': str(model.device), 'state': _cpu(model.module.state_dict())}


def _scenario_syncbn():
    """One forward and backward of test_syncbn's converted conv model, against plain BatchNorm at 2B."""
    rank, device = dist.get_rank(), _device()
    x = syncbn._data('2d')[0][:2 * syncbn.B].to(device)
    weights = torch.linspace(-1, 2, 2 * syncbn.B * 3, device=device).view(2 * syncbn.B, 3)  # a loss with a slope
    mine = slice(rank * syncbn.B, (rank + 1) * syncbn.B)
    model = torchbearer_dist.convert_sync_batchnorm(syncbn._model('2d', syncbn.SEED)).to(device)
    xr = x[mine].clone().requires_grad_()
    out = model(xr)
    (out * weights[mine]).sum().backward()
    result = {'device': str(out.device), 'layer': type(model[1]).__name__, 'out': out.detach().cpu(),
              'x_grad': xr.grad.cpu(), 'grads': {n: p.grad.cpu() for n, p in model.named_parameters()},
              'state': _cpu(model.state_dict())}
    plain = syncbn._model('2d', syncbn.SEED).to(device)
    xp = x.clone().requires_grad_()
    out = plain(xp)
    (out * weights).sum().backward()
    result['reference'] = {'out': out.detach()[mine].cpu(), 'x_grad': xp.grad[mine].cpu(),
                           'grads': {n: p.grad.cpu() for n, p in plain.named_parameters()},
                           'state': _cpu(plain.state_dict())}
    return result


def _scenario_diloco(folder):
    """DiLoCo (3 local steps) with a step checkpoint every 4 steps: at steps 4 and 8, between two outer steps,
    every rank's local weights and optimizer state are gathered to rank 0 (a gather gloo takes on CPU only)."""
    rank, device = dist.get_rank(), _device()
    model = equivalence._model('mlp', equivalence.SEED + rank).to(device)
    dataset = TensorDataset(*equivalence._data())
    loader = DataLoader(dataset, batch_size=equivalence.B, sampler=DistributedSampler(dataset, shuffle=True, seed=1))
    path = os.path.join(folder, 'diloco.pt')
    callbacks = [torchbearer_dist.Checkpoint(path, every_steps=4, keep=3),
                 *torchbearer_dist.distributed_callbacks(local_steps=3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=equivalence.LR, momentum=equivalence.MOMENTUM)
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), callbacks=callbacks, verbose=0).to(device)
    trial.with_train_generator(loader).run(1)
    locals_ = None
    if rank == 0:  # every checkpoint kept: the step ones hold each rank's local state, on the device it trained on
        locals_ = []
        for name in sorted(os.listdir(folder)):
            saved = torch.load(os.path.join(folder, name), weights_only=True, map_location='cpu')
            diloco = next(e['state'] for e in saved['callbacks'] if e['type'].endswith('.DiLoCo'))
            locals_.append((diloco['inner_steps'], len(diloco['local'] or ())))
    return {'device': str(next(model.parameters()).device), 'state': _cpu(model.state_dict()), 'locals': locals_}


def _worker_one_device(folder):
    _exact_float32()
    results = run_in_step([('allreduce', _scenario_allreduce), ('ddp', _scenario_ddp),
                           ('diloco', functools.partial(_scenario_diloco, folder)), ('syncbn', _scenario_syncbn)])
    if dist.get_rank() == 0:
        results['reference'] = _reference_on(_device())
    return results


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
    return run_workers(_worker_one_device, 2, args=(str(tmp_path_factory.mktemp('diloco')),), deadline=150)


def _assert_like_the_reference(per_rank, name):
    rank0, rank1 = scenario_values(per_rank, name)
    assert rank0['device'] == rank1['device'] == str(_device())
    reference = per_rank[0]['reference']
    initial = _cpu(equivalence._model('mlp', equivalence.SEED).state_dict())
    assert _max_difference(reference, initial) > 1e-2  # it trained
    for rank, result in enumerate((rank0, rank1)):
        difference = _max_difference(result['state'], reference)
        assert difference < TOLERANCE, 'rank {}: {:.3g} from one process at 2B'.format(rank, difference)


def _one_device(test):
    for mark in ONE_DEVICE:
        test = mark(test)
    return test


@_one_device
def test_two_gloo_ranks_on_one_gpu_match_one_process_at_twice_the_batch(one_device):
    _assert_like_the_reference(one_device, 'allreduce')


@_one_device
def test_ddp_path_with_both_ranks_on_one_gpu_matches_one_process(one_device):
    _assert_like_the_reference(one_device, 'ddp')


@_one_device
def test_syncbn_on_one_gpu_over_gloo_matches_plain_batchnorm_at_twice_the_batch(one_device):
    rank0, rank1 = scenario_values(one_device, 'syncbn')
    # Under gloo, CUDA inputs take the package's own function (torch's SyncBatchNorm needs nccl).
    assert rank0['layer'] == 'SyncBatchNorm' and rank0['device'] == str(_device())
    for rank, result in enumerate((rank0, rank1)):
        expected = result['reference']
        for what in ('out', 'x_grad'):
            difference = (result[what] - expected[what]).abs().max().item()
            assert difference < TOLERANCE, 'rank {} {}: {:.3g}'.format(rank, what, difference)
        # Running statistics are the global batch's on every rank.
        assert _max_difference(result['state'], expected['state']) < TOLERANCE, rank
    # Parameter gradients are each rank's share: their sum is the reference's (what gradient averaging sums).
    summed = {name: rank0['grads'][name] + rank1['grads'][name] for name in rank0['grads']}
    assert _max_difference(summed, rank0['reference']['grads']) < TOLERANCE
    assert rank0['reference']['grads']['1.weight'].abs().max() > 1e-3  # the BatchNorm weight had a gradient


# -- a CUDA checkpoint resumed on a CPU-only process -----------------------------------------------

def _checkpoint_trial(device, path):
    model = equivalence._model('mlp', equivalence.SEED).to(device)
    dataset = TensorDataset(*equivalence._data())
    loader = DataLoader(dataset, batch_size=equivalence.B, sampler=DistributedSampler(dataset, shuffle=True, seed=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=equivalence.LR, momentum=equivalence.MOMENTUM)
    callbacks = [torchbearer_dist.Checkpoint(path), *torchbearer_dist.distributed_callbacks()]
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'], callbacks=callbacks, verbose=0)
    return trial.to(device).with_train_generator(loader), model, optimizer


def _worker_save_on_device(folder):
    """Train one epoch on the device (the checkpoint), keep a copy, then a second epoch there too."""
    _exact_float32()
    path = os.path.join(folder, 'run.pt')
    trial, model, _ = _checkpoint_trial(_device(), path)
    trial.run(1)
    shutil.copy(path, os.path.join(folder, 'epoch1.pt'))
    after_one = _cpu(model.state_dict())
    trial.run(2)
    return {'after_one': after_one, 'after_two': _cpu(model.state_dict()), 'device': str(model[0].weight.device)}


def _worker_resume_on_cpu(folder):
    """A process that never sees CUDA: load the device's checkpoint and train the second epoch."""
    os.environ['CUDA_VISIBLE_DEVICES'] = ''  # before this process's first CUDA call: it has no GPU
    _exact_float32()
    trial, model, optimizer = _checkpoint_trial(torch.device('cpu'), os.path.join(folder, 'resumed.pt'))
    torchbearer_dist.load_checkpoint(os.path.join(folder, 'epoch1.pt'), trial=trial)
    loaded = _cpu(model.state_dict())
    momentum = [optimizer.state[p]['momentum_buffer'].device.type for p in model.parameters()]
    history = trial.run(2)
    return {'cuda': torch.cuda.is_available(), 'loaded': loaded, 'momentum_devices': momentum,
            'history': history, 'after_two': _cpu(model.state_dict())}


@_one_device
def test_checkpoint_saved_on_gpu_resumes_on_cpu(tmp_path):
    (saved,) = run_workers(_worker_save_on_device, 1, args=(str(tmp_path),), deadline=120)
    assert saved['device'] == str(_device())
    (resumed,) = run_workers(_worker_resume_on_cpu, 1, args=(str(tmp_path),), deadline=120)
    assert not resumed['cuda']
    for name, value in resumed['loaded'].items():
        assert torch.equal(value, saved['after_one'][name]), '{} differs after loading'.format(name)
    assert resumed['momentum_devices'] == ['cpu'] * 4  # the optimizer's state came across, on the CPU
    assert len(resumed['history']) == 2  # it went on with the second epoch only
    # The second epoch on the CPU from the loaded state is the device's own second epoch.
    difference = _max_difference(resumed['after_two'], saved['after_two'])
    assert difference < TOLERANCE, '{:.3g} from the run that stayed on the device'.format(difference)
    assert _max_difference(resumed['after_two'], saved['after_one']) > 1e-3  # the second epoch trained


# -- wrap_ddp's device argument (CPU; runs everywhere) ------------------------------------------------

def test_wrap_ddp_device_argument_is_validated_before_wrapping():
    with world_of_one():
        with pytest.raises(ValueError, match=r"give wrap_ddp local_rank or device, not both, but given "
                                             r"local_rank=0 and device='cpu'"):
            torchbearer_dist.wrap_ddp(nn.Linear(2, 2), local_rank=0, device='cpu')
        for bad in ('meta', 'gpu0', 3.5):
            with pytest.raises(ValueError, match=r"device should be 'cpu' or a CUDA device such as 'cuda:0', "
                                                 r"but given {!r}".format(bad).replace('.', r'\.')):
                torchbearer_dist.wrap_ddp(nn.Linear(2, 2), device=bad)
        missing = 'cuda:{}'.format(torch.cuda.device_count())  # one past the last visible GPU
        visible = r'cuda:0 to cuda:\d+' if torch.cuda.device_count() else r"this process sees none: pass device='cpu'"
        with pytest.raises(ValueError, match=r"device should name a visible GPU \({}\), but given '{}'".format(
                visible, missing)):
            torchbearer_dist.wrap_ddp(nn.Linear(2, 2), device=missing)
        # 'cpu' wraps for the CPU even on a machine with CUDA: CPU tests of the DDP path run anywhere.
        wrapped = torchbearer_dist.wrap_ddp(nn.Linear(2, 2), device=torch.device('cpu'))
        assert wrapped.device == torch.device('cpu') and wrapped.module.weight.device.type == 'cpu'
        assert wrapped.device_ids is None


# -- the switch: TORCHBEARER_DIST_TEST_GPU=1 (CPU; checks the harness on a machine without CUDA) -------------

#: Two gpu tests, each with a skipif of its own ('needs 1 GPU', 'needs 2 GPUs') that the switch must beat.
_GPU_TESTS = ['tests/e2e/test_gpu.py::test_one_rank_nccl_ddp_trains_in_a_trial',
              'tests/e2e/test_gpu.py::test_two_ranks_nccl_ddp_end_with_identical_parameters']


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the switch where CUDA is missing')
def test_the_gpu_switch_fails_the_gpu_tests_without_cuda_and_without_the_switch_they_skip():
    command = [sys.executable, '-m', 'pytest', '-n', '0', '-p', 'no:cacheprovider', '-q', *_GPU_TESTS]
    env = child_env(TORCHBEARER_DIST_TEST_GPU='1')
    env.pop('TORCHBEARER_DIST_TEST_DEVICE', None)
    asked = run_command(command, env=env, timeout=120, cwd=ROOT)
    assert asked.returncode == 1 and '2 errors' in asked.stdout, asked.stdout[-3000:] + asked.stderr[-3000:]
    line = ('CUDA is not available, though TORCHBEARER_DIST_TEST_GPU=1 asks for the GPU tests: run them on a machine '
            'with a GPU, or unset TORCHBEARER_DIST_TEST_GPU')
    for name in _GPU_TESTS:  # each fails with the one line, not a traceback
        assert re.search(r'ERROR at setup of {} _+\n{}\n'.format(name.split('::')[1], re.escape(line)), asked.stdout), \
            asked.stdout[-3000:]
    env.pop('TORCHBEARER_DIST_TEST_GPU')
    plain = run_command(command, env=env, timeout=120, cwd=ROOT)
    assert plain.returncode == 0 and '2 skipped' in plain.stdout, plain.stdout[-3000:] + plain.stderr[-3000:]


@_one_device
def test_diloco_step_checkpoints_gather_each_ranks_state_from_the_gpu(one_device):
    rank0, rank1 = scenario_values(one_device, 'diloco')
    assert rank0['device'] == rank1['device'] == str(_device())
    # newest first: the epoch's end (an outer step: nothing local), step 8 (2 local steps), step 4 (1)
    assert rank0['locals'] == [(0, 0), (2, 2), (1, 2)], rank0['locals']
