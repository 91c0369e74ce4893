"""The trainable set may change at any callback (issue 26): progressive unfreezing, exact against one process.

Layers start frozen and a callback of the user's, listed after the package's, unfreezes them and
adds a param group mid-run: at ``on_start_training``, at ``on_sample`` of a step, or at
``on_step_training`` (taking effect at the next step); a parameter also stops being trainable. Every
rank equals one process at N x B. A change made on one rank only stops every rank with one message
naming the parameter. Every scenario of one world size runs in one launch of real gloo ranks.
"""
import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 6
EPOCHS = 2
SEED = 5


def _model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    for p in list(model[0].parameters()) + list(model[2].parameters()):
        p.requires_grad = False  # the backbone starts frozen
    return model


def _data(world_size):
    g = torch.Generator().manual_seed(17)
    n = world_size * B * STEPS
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


class _Unfreeze(Callback):
    """Progressive unfreezing: at ``when`` (a hook name, and for step hooks the batch), a layer becomes trainable
    and joins the optimizer in a param group of its own; with ``freeze``, the head's bias stops being trainable."""

    def __init__(self, model, when, batch=None, only_rank=None, freeze=None):
        super().__init__()
        self.model, self.when, self.batch, self.only_rank, self.freeze = model, when, batch, only_rank, freeze
        self.layers = [self.model[0], self.model[2]] if when == 'on_start_training' else [self.model[0]]

    def _act(self, state, hook):
        if hook != self.when or (self.batch is not None and (state[torchbearer.EPOCH], state[torchbearer.BATCH])
                                 != self.batch):
            return
        if self.only_rank is not None and dist.get_rank() != self.only_rank:
            return
        for layer in self.layers:
            if not layer.weight.requires_grad:
                for p in layer.parameters():
                    p.requires_grad = True
                state[torchbearer.OPTIMIZER].add_param_group({'params': list(layer.parameters()), 'lr': 0.05})
        if self.freeze is not None:
            self.model[4].bias.requires_grad = False

    def on_start_training(self, state):
        self._act(state, 'on_start_training')

    def on_sample(self, state):
        self._act(state, 'on_sample')

    def on_step_training(self, state):
        self._act(state, 'on_step_training')


def _train(world_size, distributed, when, batch=None, only_rank=None, freeze=None, **options):
    rank = dist.get_rank() if distributed else 0
    model = _model(SEED + rank)  # ranks start apart: rank 0's weights are broadcast
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    dataset = _data(world_size)
    if distributed:
        loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
        ours = torchbearer_dist.distributed_callbacks(**options)
    else:
        loader, ours = DataLoader(dataset, batch_size=world_size * B), []
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'],
                  callbacks=ours + [_Unfreeze(model, when, batch, only_rank, freeze)], verbose=0)
    trial.with_train_generator(loader).run(EPOCHS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = {
    'on_start_training': dict(when='on_start_training'),
    'on_sample': dict(when='on_sample', batch=(0, 3)),
    'on_step_training': dict(when='on_step_training', batch=(0, 2), freeze=True),
    'on_sample, overlapped buckets': dict(when='on_sample', batch=(1, 1), overlap=True, bucket_cap_mb=1e-4,
                                          first_bucket_mb=1e-4),
}


def _scenario_one_rank_only():
    try:
        _train(dist.get_world_size(), True, 'on_sample', batch=(0, 2), only_rank=0)
    except RuntimeError as error:
        return str(error)
    return None


def _scenario_powersgd():
    """PowerSGD holds no bucket for the word to ride in: it travels in a flag all-reduce of its own."""
    return _train(dist.get_world_size(), True, 'on_sample', batch=(0, 3), compression='powersgd', powersgd_rank=1)


def _worker():
    world_size = dist.get_world_size()
    scenarios = [(name, lambda case=case: _train(world_size, True, **case)) for name, case in CASES.items()]
    return run_in_step(scenarios + [('one rank only', _scenario_one_rank_only), ('powersgd', _scenario_powersgd)])


@pytest.fixture(scope='module', params=[2, 3], ids=['2ranks', '3ranks'])
def world(request):
    """One launch per world size runs every scenario."""
    return request.param, run_workers(_worker, request.param, deadline=150)


@pytest.mark.slow
@pytest.mark.parametrize('name', list(CASES))
def test_unfreezing_at_any_callback_equals_one_process(world, name):
    world_size, results = world
    case = {k: v for k, v in CASES[name].items() if k in ('when', 'batch', 'freeze')}
    expected = _train(world_size, False, **case)
    for replica in scenario_values(results, name):
        difference = max((replica[k] - expected[k]).abs().max().item() for k in expected)
        print('{}, {} ranks: max abs parameter difference {:.2e}'.format(name, world_size, difference))
        assert difference < 1e-6
    frozen = _model(SEED)  # the backbone did move: its unfreezing was followed, not ignored
    assert not torch.equal(expected['0.weight'], frozen[0].weight)


@pytest.mark.slow
def test_unfreezing_under_powersgd_keeps_the_replicas_identical(world):
    _, results = world
    replicas = scenario_values(results, 'powersgd')
    for replica in replicas[1:]:  # approximate averages, but the same on every rank: the sentinel saw no drift
        assert all(torch.equal(replica[k], replicas[0][k]) for k in replicas[0])
    assert not torch.equal(replicas[0]['0.weight'], _model(SEED)[0].weight)


@pytest.mark.slow
def test_a_change_on_one_rank_only_stops_every_rank_naming_the_parameter(world):
    world_size, results = world
    values = scenario_values(results, 'one rank only')
    others = 'rank 1' if world_size == 2 else 'ranks 1, 2'
    assert values == [
        "the trainable parameters differ across ranks at epoch 0, batch 2: '0.weight' is trainable on rank 0 and not "
        "on {} (it was not trainable on every rank before); change requires_grad and the optimizers' param groups "
        "alike on every rank, from a callback that every rank runs".format(others)] * world_size
