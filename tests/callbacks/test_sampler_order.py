"""Samplers are found by what objects hold, and a shuffling order that repeats is loud (issue 26, item 1).

torchbearer's custom_loaders notebook zips two DataLoaders in a ``DataLoader`` subclass that never
runs ``DataLoader.__init__``: its two DistributedSamplers are found and reshuffled, and 2 (and 3)
ranks at B equal one process at N x B. A loader that keeps its sampler where ``set_epoch`` cannot
reach it (in a closure) stops every rank at the start of the second epoch, naming it; with
``check_order='warn'`` rank 0 warns once instead; a loader that does not shuffle never triggers.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, TensorDataset
from torchbearer import Callback, Trial, deep_to

import torchbearer_dist
from torchbearer_dist.data import describe_search, distributed_samplers
from torchbearer_dist.data.loaders import _order_print, _reachable_deep

from _dist import run_in_step, run_workers, scenario_values

B = 4
STEPS = 5
EPOCHS = 2
SEED = 11
LR = 0.1


# Hack to join two versions of CIFAR together  (torchbearer's custom_loaders notebook, verbatim)
class ZipLoader(DataLoader):
  def __init__(self, loader1, loader2):
    self.gen1 = loader1
    self.gen2 = loader2
    self.loader1 = loader1
    self.loader2 = loader2

  def __iter__(self):
    self.loader1 = iter(self.gen1)
    self.loader2 = iter(self.gen2)
    return self

  def __len__(self):
    return len(self.loader1)

  def __next__(self):
    return self.next()

  def next(self):
    return next(self.loader1), next(self.loader2)


def custom_loader(state):
    """The notebook's loader: the two batches side by side, the two labels as one of 3 x 3 classes."""
    (x1, y1), (x2, y2) = deep_to(next(state[torchbearer.ITERATOR]), state[torchbearer.DEVICE],
                                 state[torchbearer.DATA_TYPE])
    state[torchbearer.X], state[torchbearer.Y_TRUE] = torch.cat((x1, x2), 1), 3 * y1 + y2


def _datasets(world_size):
    g = torch.Generator().manual_seed(5)
    n = world_size * B * STEPS
    return [TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(2)]


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 9))


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zip(datasets, batch_size, **sampler_kwargs):
    return ZipLoader(*(DataLoader(d, batch_size=batch_size, sampler=DistributedSampler(d, shuffle=True, seed=3,
                                                                                       **sampler_kwargs))
                       for d in datasets))


def _reference(world_size):
    """One process at N x B: the notebook's loop, set_epoch by hand on the two samplers it holds."""
    model = _model(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = _zip(_datasets(world_size), world_size * B, num_replicas=1, rank=0)
    for epoch in range(EPOCHS):
        loader.gen1.sampler.set_epoch(epoch)
        loader.gen2.sampler.set_epoch(epoch)
        for (x1, y1), (x2, y2) in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.cat((x1, x2), 1)), 3 * y1 + y2).backward()
            optimizer.step()
    return _snapshot(model)


class _Steps(Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_step_training(self, state):
        self.steps += 1


def _trial(model, loader, callbacks, epochs, with_loader=None):
    """Run; return what the test reads: warnings about samplers, steps run, and the error if one stopped it."""
    steps = _Steps()
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), nn.CrossEntropyLoss(),
                  callbacks=[*callbacks, steps], verbose=0).with_train_generator(loader)
    if with_loader is not None:
        trial.with_loader(with_loader)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            trial.run(epochs)
        except RuntimeError as e:
            error = str(e)
    return {'warnings': [str(w.message) for w in caught if 'ampler' in str(w.message)], 'steps': steps.steps,
            'error': error}


def _scenario_zip():
    model = _model(SEED + dist.get_rank())
    loader = _zip(_datasets(dist.get_world_size()), B)
    result = _trial(model, loader, torchbearer_dist.distributed_callbacks(), EPOCHS, with_loader=custom_loader)
    return dict(result, state=_snapshot(model), epochs=[s.epoch for s in distributed_samplers(loader)],
                found=len(distributed_samplers(loader)))


class _Hidden:
    """A loader that holds its DataLoader only in a closure: no attribute leads to its sampler."""

    def __init__(self, loader):
        def batches():
            yield from loader
        self._batches = batches
        self._length = len(loader)

    def __iter__(self):
        return self._batches()

    def __len__(self):
        return self._length


def _hidden(shuffle):
    g = torch.Generator().manual_seed(6)
    n = dist.get_world_size() * B * STEPS
    dataset = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 9, (n,), generator=g))
    return _Hidden(DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=shuffle)))


def _with_check_order(check_order):
    callbacks = torchbearer_dist.distributed_callbacks()
    return [torchbearer_dist.SetSamplerEpoch(check_order=check_order)
            if isinstance(c, torchbearer_dist.SetSamplerEpoch) else c for c in callbacks]


def _scenario_hidden():
    return _trial(_model(SEED), _hidden(True), torchbearer_dist.distributed_callbacks(), 3)


def _scenario_hidden_warn():
    return _trial(_model(SEED), _hidden(True), _with_check_order('warn'), 3)


def _scenario_hidden_off():
    return _trial(_model(SEED), _hidden(True), _with_check_order(False), 3)


def _scenario_not_shuffled():
    return _trial(_model(SEED), _hidden(False), torchbearer_dist.distributed_callbacks(), 3)


class _Reseed(Callback):
    """Seeds torch's global generator alike at every epoch start: a RandomSampler draws the same order again."""

    def on_start_epoch(self, state):
        torch.manual_seed(0)


def _random(reseed):
    g = torch.Generator().manual_seed(8)
    dataset = TensorDataset(torch.randn(B * STEPS, 8, generator=g), torch.randint(0, 9, (B * STEPS,), generator=g))
    callbacks = torchbearer_dist.distributed_callbacks()
    return _trial(_model(SEED), DataLoader(dataset, batch_size=B, shuffle=True),
                  [_Reseed(), *callbacks] if reseed else callbacks, 3)


def _worker(names):
    torch.set_num_threads(1)
    scenarios = {'zip': _scenario_zip, 'hidden': _scenario_hidden, 'hidden_warn': _scenario_hidden_warn,
                 'hidden_off': _scenario_hidden_off, 'not_shuffled': _scenario_not_shuffled,
                 'random_reseeded': lambda: _random(True), 'random': lambda: _random(False)}
    return run_in_step((name, scenarios[name]) for name in names)


@pytest.fixture(scope='module')
def two():
    return run_workers(_worker, 2, args=(['zip', 'hidden', 'hidden_warn', 'hidden_off', 'not_shuffled',
                                         'random_reseeded', 'random'],), deadline=90)


@pytest.fixture(scope='module')
def three():
    return run_workers(_worker, 3, args=(['zip', 'hidden'],), deadline=90)


def _max_difference(actual, expected):
    return max((actual[k] - expected[k]).abs().max().item() for k in expected)


REPEATED = ("the training loader (_Hidden) repeats epoch 0's sample order in epoch 1: its DistributedSampler shuffles "
            'but was not reshuffled (its epoch is still 0: set_epoch was not called)')
RAISED = REPEATED + ("; call set_epoch(epoch) on the sampler at each epoch start, hold it where SetSamplerEpoch finds "
                     "it (the loader's sampler, or an attribute of the loader), or build the loader with "
                     "torchbearer_dist.distributed_loader; pass check_order='warn' (to distributed_callbacks() or "
                     'SetSamplerEpoch) if the repetition is intended')


@pytest.mark.slow
@pytest.mark.parametrize('world', ['two', 'three'])
def test_the_notebooks_zip_loader_equals_one_process_at_n_times_b(world, request):
    ranks = scenario_values(request.getfixturevalue(world), 'zip')
    size = len(ranks)
    reference = _reference(size)
    assert _max_difference(reference, _snapshot(_model(SEED))) > 1e-2  # it trained
    for rank in ranks:
        assert rank['error'] is None and rank['warnings'] == []  # no 'no DistributedSampler is reachable'
        assert rank['found'] == 2 and rank['epochs'] == [EPOCHS - 1] * 2
        assert rank['steps'] == EPOCHS * STEPS
        for name in reference:
            torch.testing.assert_close(rank['state'][name], reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('world', ['two', 'three'])
def test_a_shuffling_sampler_out_of_set_epochs_reach_stops_every_rank_in_the_second_epoch(world, request):
    ranks = scenario_values(request.getfixturevalue(world), 'hidden')
    for rank in ranks:
        assert rank['error'] == RAISED
        assert rank['steps'] == STEPS  # the first epoch, not one step of the second
        assert rank['warnings'] == []  # found in the closure: not 'no DistributedSampler is reachable'


@pytest.mark.slow
def test_an_intended_repetition_warns_once_on_rank_0(two):
    rank0, rank1 = scenario_values(two, 'hidden_warn')
    assert rank0['error'] is None and rank0['steps'] == 3 * STEPS
    assert rank0['warnings'] == [REPEATED + "; training goes on, as check_order='warn' asks"]
    assert rank1['warnings'] == [] and rank1['steps'] == 3 * STEPS
    for rank in scenario_values(two, 'hidden_off'):
        assert rank['error'] is None and rank['warnings'] == [] and rank['steps'] == 3 * STEPS


@pytest.mark.slow
def test_a_loader_that_does_not_shuffle_never_triggers(two):
    for rank in scenario_values(two, 'not_shuffled'):
        assert rank['error'] is None and rank['warnings'] == [] and rank['steps'] == 3 * STEPS


@pytest.mark.slow
def test_a_random_sampler_whose_generator_is_reseeded_each_epoch_stops_every_rank(two):
    for rank in scenario_values(two, 'random_reseeded'):
        assert rank['error'].startswith("the training loader (DataLoader) repeats epoch 0's sample order in epoch 1: "
                                        "its RandomSampler shuffles but was not reshuffled (torch's global generator, "
                                        'which it draws from, is in the same state as then); call set_epoch')
        assert rank['steps'] == STEPS
    for rank in scenario_values(two, 'random'):
        assert rank['error'] is None and rank['steps'] == 3 * STEPS


# --- One process: the search and the order prints, no ranks.

def _sharded(n=8):
    data = TensorDataset(torch.arange(float(n)))
    return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True))


def test_the_zip_loader_is_searched_by_what_it_holds_before_and_after_iter():
    loader = ZipLoader(_sharded(), _sharded())
    samplers = [loader.gen1.sampler, loader.gen2.sampler]
    assert distributed_samplers(loader) == samplers
    described = 'ZipLoader, DataLoader, DataLoader, DistributedSampler, BatchSampler, DistributedSampler, BatchSampler'
    assert describe_search(loader) == described
    iterator = iter(loader)
    next(iterator)  # loader1 and loader2 are now the DataLoaders' iterators, which hold the samplers too
    assert distributed_samplers(loader) == samplers and describe_search(loader) == described
    assert [s for s in _reachable_deep(loader, iterator) if isinstance(s, DistributedSampler)] == samplers


def test_a_sampler_in_a_closure_is_out_of_set_epochs_reach_but_the_order_check_finds_it():
    loader = _sharded()
    hidden = _Hidden(loader)
    assert distributed_samplers(hidden) == []
    assert loader.sampler in _reachable_deep(hidden)
    iterator = iter(hidden)
    next(iterator)
    assert loader.sampler in _reachable_deep(None, iterator)


class _Unknown(Sampler):
    """A shuffling sampler the package does not know: iterating it would draw from torch's global generator."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self):
        return self.n


def test_order_prints_draw_nothing_and_skip_what_does_not_shuffle_or_is_unknown():
    data = TensorDataset(torch.arange(6.0))
    generator = torch.Generator().manual_seed(1)
    own = RandomSampler(data, generator=generator)
    before, global_before = generator.get_state(), torch.random.get_rng_state()
    printed = [_order_print(own), _order_print(RandomSampler(data))]
    assert torch.equal(generator.get_state(), before) and torch.equal(torch.random.get_rng_state(), global_before)
    assert printed[0][0] == 'generator' and printed[1][0] == 'global generator'
    list(own)
    assert _order_print(own) != printed[0]  # the generator moved on: a new order
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=4)
    assert _order_print(sampler) == ('seed + epoch', 4)
    sampler.set_epoch(1)
    assert _order_print(sampler) == ('seed + epoch', 5)
    assert _order_print(DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)) is None
    assert _order_print(_Unknown(6)) is None


def test_check_order_takes_raise_warn_or_false():
    for value in ('raise', 'warn', False):
        assert torchbearer_dist.SetSamplerEpoch(check_order=value).check_order == value
    with pytest.raises(ValueError, match=r"^check_order should be 'raise', 'warn' or False, but given True$"):
        torchbearer_dist.SetSamplerEpoch(check_order=True)


def test_distributed_callbacks_passes_check_order_to_set_sampler_epoch():
    callbacks = torchbearer_dist.distributed_callbacks(check_order='warn')
    assert [c.check_order for c in callbacks if isinstance(c, torchbearer_dist.SetSamplerEpoch)] == ['warn']
    with pytest.raises(ValueError, match=r"^check_order should be 'raise', 'warn' or False, but given 'off'$"):
        torchbearer_dist.distributed_callbacks(check_order='off')
