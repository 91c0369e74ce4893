"""Canary: torchbearer's training loop still runs as ``checkpoint/_midepoch.py`` relies on to resume in mid-epoch.

The contract: ``state[ITERATOR]`` is made before ``on_start_training``, the loop's
``range(state[STEPS])`` after it, and ``state[SAMPLER](state)`` loads each batch with ``state[BATCH]``
counting from 0. Fails on the pinned torchbearer if any of it moved; the package then warns once at
run time (``_midepoch.LOST``). One process, no process group.
"""
import warnings

import pytest
import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

from torchbearer_dist import _once
from torchbearer_dist.checkpoint import _midepoch

N, B, DONE = 12, 2, 2  # six batches an epoch; two trained before the interruption


class _Resume(Callback):
    """Resumes the epoch after ``DONE`` batches, and records what each later batch looked like to callbacks."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_start_training(self, state):
        self.skipped = _midepoch.resume_epoch(state, {'batches': DONE, 'batch_size': B, 'world_size': 1}, None)

    def on_sample(self, state):
        self.seen.append((state[torchbearer.BATCH], state[torchbearer.STEPS], state[torchbearer.X][:, 0].tolist()))


def _loader(sharded):
    dataset = TensorDataset(torch.arange(N, dtype=torch.float32).view(N, 1), torch.zeros(N, 1))
    if sharded:  # the exact path: the rest of the DistributedSampler's order
        return DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, 1, 0, shuffle=False))
    return DataLoader(dataset, batch_size=B)  # any other loader: the batches done are drawn and dropped


@pytest.mark.parametrize('sharded', [True, False], ids=['by-index', 'draw-and-drop'])
def test_a_resumed_epoch_trains_the_batches_left_numbered_as_the_epoch_numbers_them(sharded):
    resume = _Resume()
    model = nn.Linear(1, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), callbacks=[resume], verbose=0)
    trial.with_generators(train_generator=_loader(sharded))
    _once._given.clear()
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the LOST warning fails the test
        trial.run(1)
    assert resume.skipped == DONE
    assert resume.seen == [(i, N // B, [2.0 * i, 2.0 * i + 1]) for i in range(DONE, N // B)]


def test_a_loop_that_made_its_range_before_on_start_training_warns_once():
    loader = _loader(True)
    state = torchbearer.State()
    state.update({torchbearer.GENERATOR: loader, torchbearer.STEPS: len(loader), torchbearer.ITERATOR: iter(loader),
                  torchbearer.SAMPLER: lambda s: s.update({torchbearer.X: next(s[torchbearer.ITERATOR])[0]})})
    steps = state[torchbearer.STEPS]  # such a loop would ignore the STEPS set for the batches left
    _midepoch.resume_epoch(state, {'batches': DONE, 'batch_size': B, 'world_size': 1}, None)
    _once._given.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for batch in range(steps - DONE + 1):  # one batch more than are left
            state[torchbearer.BATCH] = batch
            try:
                state[torchbearer.SAMPLER](state)
            except StopIteration:
                pass
    lost = [w for w in caught if 'may train again batches trained before the interruption' in str(w.message)]
    assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning)
    assert 'batch 4 loaded as the 5th of the 4 left' in str(lost[0].message)
