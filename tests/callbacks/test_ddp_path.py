"""The DDP path as safe as the package's own (issue 26): ``distributed_callbacks(ddp=True)`` with ``wrap_ddp``.

DDP averages only the model it wraps. The GAN pattern (the generator wrapped in DDP as
``state[MODEL]``, the discriminator and both optimizers under the program's own keys, stepped from
a closure) has the discriminator's gradients averaged by the package too, and equals one process at
N x B on CPU gloo. The divergence sentinel runs on this path: a discriminator whose optimizer the
state does not hold is named. A parameter unfrozen inside the DDP model, which DDP's reducer cannot
follow, stops every rank naming it.
"""
import pytest
import torch
import torch.distributed as dist
import torchbearer

# the GAN of the package's own path: the same helpers and state keys, defined once
from test_by_construction import (
    DISC_MODEL,
    DISC_OPT,
    EPOCHS,
    GEN_OPT,
    SEED,
    STEPS,
    B,
    _gan_closure,
    _gan_data,
    _gan_models,
    _gan_optimizers,
    _gan_reference,
    _max_difference,
    _snapshot,
)
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist

from _dist import run_in_step, run_workers, scenario_values  # noqa: I001 (tests/ on sys.path)


def _gan_trial(hide_disc_opt=False):
    # Seeded differently on every rank: the package broadcasts the discriminator, DDP the generator.
    generator, discriminator = _gan_models(SEED + dist.get_rank())
    generator = torchbearer_dist.wrap_ddp(generator, device='cpu')
    gen_opt, disc_opt = _gan_optimizers(generator, discriminator)
    dataset = TensorDataset(*_gan_data(dist.get_world_size() * B * STEPS))
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    trial = Trial(generator, None, metrics=['loss'], callbacks=torchbearer_dist.distributed_callbacks(ddp=True),
                  verbose=0)
    trial.state.update({DISC_MODEL: discriminator, GEN_OPT: gen_opt})
    if not hide_disc_opt:
        trial.state[DISC_OPT] = disc_opt
    trial.with_closure(_gan_closure(disc_opt if hide_disc_opt else None)).with_train_generator(loader)
    return trial, generator, discriminator


def _scenario_gan():
    trial, generator, discriminator = _gan_trial()
    trial.run(EPOCHS)
    return _snapshot(generator.module, discriminator)


def _scenario_unsynchronised():
    trial, _, _ = _gan_trial(hide_disc_opt=True)
    try:
        trial.run(EPOCHS)
    except RuntimeError as error:
        return str(error)
    return None


class _UnfreezeInside(Callback):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def on_step_training(self, state):
        if state[torchbearer.BATCH] == 1 and not self.layer.weight.requires_grad:
            for p in self.layer.parameters():
                p.requires_grad = True


def _scenario_unfrozen_inside_ddp():
    torch.manual_seed(SEED)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    for p in net[0].parameters():
        p.requires_grad = False
    model = torchbearer_dist.wrap_ddp(net, device='cpu')
    z, real = _gan_data(dist.get_world_size() * B * STEPS)
    dataset = TensorDataset(z, real)
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), verbose=0,
                  callbacks=torchbearer_dist.distributed_callbacks(ddp=True) + [_UnfreezeInside(net[0])])
    try:
        trial.with_train_generator(loader).run(1)
    except RuntimeError as error:
        return str(error)
    return None


SCENARIOS = {'gan': _scenario_gan, 'unsynchronised': _scenario_unsynchronised,
             'unfrozen inside ddp': _scenario_unfrozen_inside_ddp}


def _worker():
    return run_in_step((name, SCENARIOS[name]) for name in SCENARIOS)


@pytest.fixture(scope='module', params=[2, 3], ids=['2ranks', '3ranks'])
def world(request):
    """One launch per world size runs every scenario."""
    return request.param, run_workers(_worker, request.param, deadline=150)


@pytest.mark.slow
def test_gan_on_the_ddp_path_averages_the_discriminator_and_equals_one_process(world):
    world_size, results = world
    expected = _gan_reference(world_size)
    for replica in scenario_values(results, 'gan'):
        difference = _max_difference(replica, expected)
        print('gan with ddp=True, {} ranks: max abs parameter difference {:.2e}'.format(world_size, difference))
        assert difference < 1e-6


@pytest.mark.slow
def test_the_divergence_sentinel_runs_on_the_ddp_path(world):
    _, results = world
    values = scenario_values(results, 'unsynchronised')
    assert values == [
        "replicas diverged after the first step (epoch 0, step 1): 'state[disc_model].0.weight' differs across "
        "ranks (4 of 8 tensors differ); something updated it on one rank only, such as an optimizer or module that "
        "trial.state does not hold (store it there) or a callback that edits weights on one rank; "
        "AllReduceGradients(check_divergence=False) turns this check off"] * len(values)


@pytest.mark.slow
def test_a_parameter_unfrozen_inside_the_ddp_model_stops_every_rank_naming_it(world):
    _, results = world
    values = scenario_values(results, 'unfrozen inside ddp')
    assert values == [
        "'module.0.weight' became trainable inside the DistributedDataParallel model at epoch 0, batch 1: DDP averages "
        "only the parameters that were trainable when it was wrapped, so the replicas would drift; set requires_grad "
        "before wrap_ddp (wrap the model again after a change), or keep that part outside DDP"] * len(values)
