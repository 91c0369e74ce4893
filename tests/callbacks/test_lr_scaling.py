"""ScaleLearningRate: the learning rate of every step equals the formula on every rank, schedulers or not.

The learning rate a step uses is read inside the optimizer step (in ``on_backward``, after every
``on_sample``), for two param groups with different base rates, in both callback orders.
"""
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback
from torchbearer.callbacks import StepLR

import torchbearer_dist
from torchbearer_dist import ScaleLearningRate

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 5
EPOCHS = 3
BASES = (0.1, 0.01)
GAMMA = 0.5
#: name: (ScaleLearningRate kwargs, scheduler ('epoch': StepLR(1) per epoch, 'batch': StepLR(3) per step, None))
CONFIGS = {
    'plain': ({}, None),
    'warmup_epochs': ({'warmup_epochs': 1.5}, None),
    'warmup_steps': ({'warmup_steps': 4}, None),
    'epoch_scheduler': ({'warmup_epochs': 1.5}, 'epoch'),
    'batch_scheduler': ({'warmup_steps': 4}, 'batch'),
    'reference_batch': ({'reference_batch_size': 2, 'warmup_steps': 7}, 'batch'),
}


class _Record(Callback):
    """The learning rates the optimizer step uses, read inside the step, and those left after it."""

    def __init__(self):
        super().__init__()
        self.used, self.after = [], []

    def on_backward(self, state):
        self.used.append([group['lr'] for group in state[torchbearer.OPTIMIZER].param_groups])

    def on_end(self, state):
        self.after = [group['lr'] for group in state[torchbearer.OPTIMIZER].param_groups]


def _scheduler(kind):
    return StepLR(1, gamma=GAMMA) if kind == 'epoch' else StepLR(3, gamma=GAMMA, step_on_batch=True)


def _train(name, scale_first, world_size=2):
    options, schedule = CONFIGS[name]
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD([{'params': [model.weight], 'lr': BASES[0]}, {'params': [model.bias], 'lr': BASES[1]}])
    dataset = TensorDataset(torch.randn(world_size * B * STEPS, 3), torch.randn(world_size * B * STEPS, 2))
    sampler = DistributedSampler(dataset, shuffle=False) if world_size > 1 else None
    record, scale = _Record(), ScaleLearningRate(**options)
    ours = [scale] if schedule is None else [scale, _scheduler(schedule)] if scale_first else \
        [_scheduler(schedule), scale]
    callbacks = ours + [record] + (torchbearer_dist.distributed_callbacks() if world_size > 1 else [])
    trial = torchbearer.Trial(model, optimizer, nn.MSELoss(), callbacks=callbacks, verbose=0)
    trial.with_train_generator(DataLoader(dataset, batch_size=B, sampler=sampler))
    trial.run(EPOCHS)
    return {'used': record.used, 'after': record.after}


def _expected(name, world_size=2):
    """The formula: one-process schedule times 1 + (k - 1) * min(1, progress)."""
    options, schedule = CONFIGS[name]
    k = world_size * B / options['reference_batch_size'] if 'reference_batch_size' in options else world_size
    used = []
    for epoch, batch in itertools.product(range(EPOCHS), range(STEPS)):
        t = epoch * STEPS + batch
        if 'warmup_steps' in options:
            progress = t / options['warmup_steps']
        elif 'warmup_epochs' in options:
            progress = (epoch + batch / STEPS) / options['warmup_epochs']
        else:
            progress = 1.0
        factor = 1 + (k - 1) * min(1.0, progress)
        decay = {None: 1.0, 'epoch': GAMMA ** epoch, 'batch': GAMMA ** (t // 3)}[schedule]
        used.append([base * decay * factor for base in BASES])
    last = EPOCHS * STEPS
    decay = {None: 1.0, 'epoch': GAMMA ** EPOCHS, 'batch': GAMMA ** (last // 3)}[schedule]
    return used, [base * decay for base in BASES]


def _worker_all():
    torch.set_num_threads(1)
    return run_in_step(('{}-{}'.format(name, first), functools.partial(_train, name, first))
                       for name in sorted(CONFIGS) for first in (True, False))


@pytest.fixture(scope='module')
def trained():
    return run_workers(_worker_all, 2, deadline=120)


@pytest.mark.slow
@pytest.mark.parametrize('scale_first', [True, False], ids=['scale_first', 'scheduler_first'])
@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_learning_rate_of_every_step_follows_the_formula(trained, name, scale_first):
    used, after = _expected(name)
    for rank, value in enumerate(scenario_values(trained, '{}-{}'.format(name, scale_first))):
        assert len(value['used']) == EPOCHS * STEPS
        for step, (actual, expected) in enumerate(zip(value['used'], used)):
            assert actual == pytest.approx(expected, rel=1e-12), 'rank {} step {}'.format(rank, step)
        assert value['after'] == pytest.approx(after, rel=1e-12), 'rank {}: the unscaled rate is left'.format(rank)


@pytest.mark.parametrize('name', ['warmup_epochs', 'batch_scheduler'])
def test_job_of_one_has_factor_one(name):
    value = _train(name, True, world_size=1)
    used, after = _expected(name, world_size=1)
    assert sum(value['used'], []) == pytest.approx(sum(used, []), rel=1e-12)
    assert value['after'] == pytest.approx(after, rel=1e-12)


def test_factor_by_reference_batch_in_a_job_of_one():
    scale = ScaleLearningRate(reference_batch_size=2, warmup_steps=10)
    trial = torchbearer.Trial(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=1.0),
                              nn.MSELoss(), callbacks=[scale], verbose=0)
    trial.with_train_generator(DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 2)), batch_size=4))
    trial.run(1)
    assert scale.scale == 2.0 and scale.factor(0, 5, 2) == 1.5 and scale.factor(5, 0, 2) == 2.0


def test_bad_arguments():
    with pytest.raises(ValueError, match=r'reference_batch_size should be a positive integer or None, but given 0'):
        ScaleLearningRate(reference_batch_size=0)
    with pytest.raises(ValueError, match=r'warmup_epochs should be a number >= 0, but given -1'):
        ScaleLearningRate(warmup_epochs=-1)
    with pytest.raises(ValueError, match=r'warmup_steps should be an integer >= 0, but given 1.5'):
        ScaleLearningRate(warmup_steps=1.5)
    with pytest.raises(ValueError, match=r'give warmup_epochs or warmup_steps, not both \(given 1 and 2\)'):
        ScaleLearningRate(warmup_epochs=1, warmup_steps=2)


def test_missing_batch_size():
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 2)), batch_sampler=[[0, 1], [2, 3]])
    model = nn.Linear(3, 2)
    trial = torchbearer.Trial(model, torch.optim.SGD(model.parameters(), lr=1.0), nn.MSELoss(),
                              callbacks=[ScaleLearningRate(reference_batch_size=4)], verbose=0)
    trial.with_train_generator(loader)
    with pytest.raises(ValueError, match=r"cannot find this rank's batch size \(the training loader gives None\)"):
        trial.run(1)
    assert dist.is_initialized() is False
