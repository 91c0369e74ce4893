"""torchbearer's own programs, distributed: exact against one process at N x B, or a loud error (issue 15).

The patterns of torchbearer's notebooks, shrunk: a GAN keeping its discriminator and both
optimizers under keys of its own, stepped from a closure; a VAE with a summed loss and an
``@add_to_loss`` KL term; a wrapper loader that zips two DataLoaders, each with its own
DistributedSampler; an unseeded ``DatasetValidationSplitter``; and a parameter left unsynchronised
on purpose. Every scenario of one world size runs in one launch of real gloo ranks; the references
are computed here, in one process at N x B.
"""
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Trial
from torchbearer.callbacks import add_to_loss
from torchbearer.cv_utils import DatasetValidationSplitter

import torchbearer_dist
from torchbearer_dist.callbacks.comm_report import REPORT_KEYS
from torchbearer_dist.data import distributed_samplers

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 4
EPOCHS = 2
SEED = 7

DISC_MODEL = torchbearer.state_key('disc_model')
DISC_OPT = torchbearer.state_key('disc_opt')
GEN_OPT = torchbearer.state_key('gen_opt')
MU = torchbearer.state_key('mu')
LOGVAR = torchbearer.state_key('logvar')


def _snapshot(*modules):
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]


def _max_difference(actual, expected):
    return max((a[k] - e[k]).abs().max().item() for a, e in zip(actual, expected) for k in e)


# --- GAN: the generator is state[MODEL]; the discriminator and both optimizers live under the program's keys.

def _gan_data(n):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, 3, generator=g), torch.randn(n, 4, generator=g) * 0.5 + 1.0


def _gan_models(seed):
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return generator, discriminator


def _gan_step(generator, discriminator, gen_opt, disc_opt, z, real):
    """torchbearer's gan notebook in short: a generator pass and step, then a discriminator pass and step."""
    bce = nn.functional.binary_cross_entropy_with_logits
    gen_opt.zero_grad()
    fake = generator(z)
    g_loss = bce(discriminator(fake), torch.ones(len(z), 1))
    g_loss.backward()
    gen_opt.step()
    disc_opt.zero_grad()
    d_loss = (bce(discriminator(real), torch.ones(len(z), 1)) + bce(discriminator(fake.detach()),
                                                                      torch.zeros(len(z), 1))) / 2
    d_loss.backward()
    disc_opt.step()
    return fake, g_loss


def _gan_optimizers(generator, discriminator):
    return (torch.optim.SGD(generator.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(discriminator.parameters(), lr=0.1, momentum=0.9))


def _gan_reference(world_size):
    generator, discriminator = _gan_models(SEED)
    gen_opt, disc_opt = _gan_optimizers(generator, discriminator)
    z, real = _gan_data(world_size * B * STEPS)
    for _ in range(EPOCHS):
        for zb, rb in DataLoader(TensorDataset(z, real), batch_size=world_size * B):
            _gan_step(generator, discriminator, gen_opt, disc_opt, zb, rb)
    return _snapshot(generator, discriminator)


def _gan_closure(hidden_disc_opt=None):
    def closure(state):
        disc_opt = hidden_disc_opt or state[DISC_OPT]
        fake, g_loss = _gan_step(state[torchbearer.MODEL], state[DISC_MODEL], state[GEN_OPT], disc_opt,
                                 state[torchbearer.X], state[torchbearer.Y_TRUE])
        state[torchbearer.Y_PRED], state[torchbearer.LOSS] = fake, g_loss
    return closure


def _gan_trial(hide_disc_opt=False):
    # Seeded differently on every rank: BroadcastParameters must copy both models from rank 0.
    generator, discriminator = _gan_models(SEED + dist.get_rank())
    gen_opt, disc_opt = _gan_optimizers(generator, discriminator)
    dataset = TensorDataset(*_gan_data(dist.get_world_size() * B * STEPS))
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False))
    trial = Trial(generator, None, metrics=['loss'], callbacks=torchbearer_dist.distributed_callbacks(), verbose=0)
    trial.state.update({DISC_MODEL: discriminator, GEN_OPT: gen_opt})
    if not hide_disc_opt:
        trial.state[DISC_OPT] = disc_opt
    trial.with_closure(_gan_closure(disc_opt if hide_disc_opt else None)).with_train_generator(loader)
    return trial, generator, discriminator


def _scenario_gan():
    trial, generator, discriminator = _gan_trial()
    trial.run(EPOCHS)
    return _snapshot(generator, discriminator)


def _scenario_unsynchronised():
    """The discriminator's optimizer kept out of trial.state: its gradients stay local, and the sentinel says so."""
    trial, _, _ = _gan_trial(hide_disc_opt=True)
    try:
        trial.run(EPOCHS)
    except RuntimeError as error:
        return str(error)
    return None


# --- VAE: a summed reconstruction loss, a summed KL term added by @add_to_loss, forward(x, state).

class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.mu, self.logvar = nn.Linear(8, 2), nn.Linear(8, 2)
        self.decoder = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, x, state):
        h = torch.tanh(self.encoder(x))
        mu, logvar = self.mu(h), self.logvar(h)
        state[MU], state[LOGVAR] = mu, logvar
        noise = torch.sin(7.0 * x[:, :2])  # the notebook draws it; fixed per sample here, to compare exactly
        return self.decoder(mu + noise * torch.exp(0.5 * logvar))


@add_to_loss
def _kl(state):
    mu, logvar = state[MU], state[LOGVAR]
    return -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def _vae_data(world_size):
    g = torch.Generator().manual_seed(12)
    return torch.randn(world_size * B * STEPS, 6, generator=g), torch.randn(world_size * B * 2, 6, generator=g)


def _vae_trial(model, loaders, callbacks):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.5)
    trial = Trial(model, optimizer, nn.MSELoss(reduction='sum'), metrics=['loss'], callbacks=[_kl, *callbacks],
                  verbose=0)
    return trial.with_generators(*loaders)


def _vae_reference(world_size):
    torch.manual_seed(SEED)
    model = _VAE()
    train, val = _vae_data(world_size)
    loaders = [DataLoader(TensorDataset(x, x), batch_size=world_size * B) for x in (train, val)]
    history = _vae_trial(model, loaders, []).run(EPOCHS)
    return {'state': _snapshot(model), 'history': history}


def _scenario_vae():
    torch.manual_seed(SEED + dist.get_rank())
    model = _VAE()
    loaders = []
    for x in _vae_data(dist.get_world_size()):
        dataset = TensorDataset(x, x)
        loaders.append(DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False)))
    history = _vae_trial(model, loaders, torchbearer_dist.distributed_callbacks()).run(EPOCHS)
    return {'state': _snapshot(model), 'history': history}


# --- A custom loader that zips two DataLoaders, each with its own shuffling DistributedSampler.

class _ZipLoader:
    """One batch from each loader, concatenated (torchbearer's custom_loaders notebook, in short)."""

    def __init__(self, *loaders):
        self.loaders = loaders

    def __iter__(self):
        for batches in zip(*self.loaders):
            yield torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])

    def __len__(self):
        return min(len(loader) for loader in self.loaders)


def _zip_datasets(world_size):
    g = torch.Generator().manual_seed(13)
    n = world_size * B * STEPS
    return [TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(2)]


def _zip_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _zip_reference(world_size):
    model = _zip_model(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    samplers = [DistributedSampler(d, num_replicas=1, rank=0, shuffle=True, seed=3) for d in _zip_datasets(world_size)]
    loader = _ZipLoader(*(DataLoader(s.dataset, batch_size=world_size * B, sampler=s) for s in samplers))
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return _snapshot(model)


def _scenario_zip():
    model = _zip_model(SEED + dist.get_rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    datasets = _zip_datasets(dist.get_world_size())
    loader = _ZipLoader(*(DataLoader(d, batch_size=B, sampler=DistributedSampler(d, shuffle=True, seed=3))
                          for d in datasets))
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), callbacks=torchbearer_dist.distributed_callbacks(),
                  verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trial.with_train_generator(loader).run(EPOCHS)
    return {'state': _snapshot(model), 'epochs': [s.epoch for s in distributed_samplers(loader)],
            'warnings': [str(w.message) for w in caught if 'DistributedSampler' in str(w.message)]}


# --- torchbearer's DatasetValidationSplitter, unseeded: each rank draws its own split.

def _scenario_unseeded_split():
    g = torch.Generator().manual_seed(14)
    dataset = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    random.seed(1000 + dist.get_rank())  # what an unseeded process's random module amounts to
    splitter = DatasetValidationSplitter(len(dataset), 0.25)
    loaders = [torchbearer_dist.distributed_loader(d, batch_size=B)
               for d in (splitter.get_train_dataset(dataset), splitter.get_val_dataset(dataset))]
    model = _zip_model(SEED)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                  callbacks=torchbearer_dist.distributed_callbacks(), verbose=0).with_generators(*loaders)
    before = _snapshot(model)
    try:
        trial.run(1)
    except RuntimeError as error:
        return {'error': str(error), 'untouched': _max_difference(_snapshot(model), before) == 0}
    return None


# --- Something that cannot be synchronised, under a key of the program's own: every rank stops before step 1.

class _SparseTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3).to_sparse())


SPARSE = torchbearer.state_key('sparse_table')
SPARSE_OPT = torchbearer.state_key('sparse_opt')


def _scenario_unsupported():
    model = _zip_model(SEED)
    table = _SparseTable()
    dataset = _zip_datasets(dist.get_world_size())[0]
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                  callbacks=torchbearer_dist.distributed_callbacks(), verbose=0)
    trial.state.update({SPARSE: table, SPARSE_OPT: torch.optim.SGD(table.parameters(), lr=0.1)})
    trial.with_train_generator(torchbearer_dist.distributed_loader(dataset, batch_size=B))
    before = _snapshot(model)
    try:
        trial.run(1)
    except ValueError as error:
        return {'error': str(error), 'untouched': _max_difference(_snapshot(model), before) == 0}
    return None


def _scenario_overlapping_shards():
    """Samplers whose shards overlap: seeded per rank, or every rank told it is rank 0."""
    dataset = _zip_datasets(dist.get_world_size())[0]
    messages = []
    for sampler in (DistributedSampler(dataset, shuffle=True, seed=dist.get_rank()),
                    DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=0)):
        model = _zip_model(SEED)
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      callbacks=torchbearer_dist.distributed_callbacks(), verbose=0)
        trial.with_train_generator(DataLoader(dataset, batch_size=B, sampler=sampler))
        try:
            trial.run(1)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


SCENARIOS = {'gan': _scenario_gan, 'vae': _scenario_vae, 'zip': _scenario_zip,
             'unseeded_split': _scenario_unseeded_split, 'unsynchronised': _scenario_unsynchronised,
             'unsupported': _scenario_unsupported, 'overlapping_shards': _scenario_overlapping_shards}


def _worker():
    torch.set_num_threads(1)
    return run_in_step((name, SCENARIOS[name]) for name in SCENARIOS)


@pytest.fixture(scope='module', params=[2, 3], ids=['2ranks', '3ranks'])
def world(request):
    """One launch per world size runs every scenario."""
    return request.param, run_workers(_worker, request.param, deadline=150)


@pytest.mark.slow
def test_gan_with_discriminator_and_optimizers_in_state_equals_one_process(world):
    world_size, results = world
    expected = _gan_reference(world_size)
    for replica in scenario_values(results, 'gan'):
        difference = _max_difference(replica, expected)
        print('gan, {} ranks: max abs parameter difference {:.2e}'.format(world_size, difference))
        assert difference < 1e-5


@pytest.mark.slow
def test_vae_with_summed_loss_equals_one_process_in_parameters_and_figures(world):
    world_size, results = world
    expected = _vae_reference(world_size)
    for replica in scenario_values(results, 'vae'):
        difference = _max_difference(replica['state'], expected['state'])
        print('vae, {} ranks: max abs parameter difference {:.2e}'.format(world_size, difference))
        assert difference < 1e-5
        for got, want in zip(replica['history'], expected['history']):
            assert set(got) - set(REPORT_KEYS) == set(want)  # CommunicationReport's figures added
            for name in ('loss', 'running_loss', 'val_loss'):
                print('  {} {:.6f} vs {:.6f}'.format(name, got[name], want[name]))
                assert got[name] == pytest.approx(want[name], rel=1e-5), name


@pytest.mark.slow
def test_zip_loader_reshuffles_its_inner_samplers_and_equals_one_process(world):
    world_size, results = world
    expected = _zip_reference(world_size)
    for replica in scenario_values(results, 'zip'):
        difference = _max_difference(replica['state'], expected)
        print('zip loader, {} ranks: max abs parameter difference {:.2e}'.format(world_size, difference))
        assert difference < 1e-5
        assert replica['epochs'] == [EPOCHS - 1, EPOCHS - 1]
        assert replica['warnings'] == []


@pytest.mark.slow
def test_unseeded_validation_split_stops_every_rank_before_step_one(world):
    _, results = world
    values = scenario_values(results, 'unseeded_split')
    assert all(v is not None and v['untouched'] for v in values)
    assert {v['error'] for v in values} == {
        'the training loader holds different samples on rank 0 and rank 1 (the indices of its subset differ); the '
        'likely cause is a random split that is not seeded: seed the split on every rank (DatasetValidationSplitter('
        '..., shuffle_seed=0), random_split(..., generator=torch.Generator().manual_seed(0)))'}


@pytest.mark.slow
def test_an_unsynchronised_discriminator_is_named_by_the_divergence_sentinel(world):
    world_size, results = world
    values = scenario_values(results, 'unsynchronised')
    assert len(set(values)) == 1
    assert values[0] == (
        "replicas diverged after the first step (epoch 0, step 1): 'state[disc_model].0.weight' differs across ranks "
        "(4 of 8 tensors differ); something updated it on one rank only, such as an optimizer or module that "
        "trial.state does not hold (store it there) or a callback that edits weights on one rank; "
        "AllReduceGradients(check_divergence=False) turns this check off")


@pytest.mark.slow
def test_a_parameter_that_cannot_be_averaged_under_a_key_of_its_own_stops_every_rank_naming_it(world):
    _, results = world
    values = scenario_values(results, 'unsupported')
    assert all(v is not None and v['untouched'] for v in values)
    assert {v['error'] for v in values} == {
        "parameter 'state[sparse_table].w' (float32, torch.sparse_coo) cannot be averaged by AllReduceGradients: "
        "only dense floating or complex parameters are; make it dense, or freeze it (requires_grad=False)"}


@pytest.mark.slow
def test_samplers_whose_shards_overlap_stop_every_rank_before_step_one(world):
    world_size, results = world
    values = scenario_values(results, 'overlapping_shards')
    assert all(v == values[0] for v in values)
    assert values[0] == [
        "the training loader has DistributedSamplers with different settings on rank 0 and rank 1 (seed, shuffle, "
        "drop_last or dataset length), so the shards of the ranks overlap; give every rank the same sampler settings",
        "the training loader has a DistributedSampler with rank=0 on ranks {}, so their shards of each epoch are the "
        "same samples; build it inside the process group (DistributedSampler(dataset) or "
        "torchbearer_dist.distributed_loader)".format('0 and 1' if world_size == 2 else '0, 1 and 2')]
