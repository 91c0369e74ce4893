"""A reshuffle each epoch: ``set_epoch`` on every sharding sampler of the Trial's loaders."""
import warnings

import torchbearer
from torchbearer import Callback

from torchbearer_dist.data import _samplers, distributed_sampler
from torchbearer_dist.sync import collectives


def _loaders(state):
    keys = (torchbearer.TRAIN_GENERATOR, torchbearer.VALIDATION_GENERATOR, torchbearer.TEST_GENERATOR)
    return [state[key] for key in keys if state.get(key) is not None]


class SetSamplerEpoch(Callback):
    """Call ``set_epoch(epoch)`` on every DistributedSampler of the Trial's loaders at each epoch start.

    Without it, a shuffling DistributedSampler repeats the same order every epoch. In a world of more
    than one rank it also warns once, on rank 0, when the training loader has no DistributedSampler:
    every rank would then train on all the data (see :func:`distributed_loader`).

    Example: ::

        >>> from torchbearer_dist import SetSamplerEpoch
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[SetSamplerEpoch()])

    State Requirements:
        - :attr:`torchbearer.state.EPOCH`: the epoch about to start
        - :attr:`torchbearer.state.TRAIN_GENERATOR`: the training loader, checked for a DistributedSampler
    """

    def __init__(self):
        super().__init__()
        self._warned = False

    def on_start(self, state):
        loader = state.get(torchbearer.TRAIN_GENERATOR)
        if self._warned or loader is None or collectives.world_size() == 1 or distributed_sampler(loader) is not None:
            return
        self._warned = True
        if collectives.rank() == 0:
            warnings.warn('the training loader has no DistributedSampler, so each of the {} ranks trains on all of '
                          'its data; build it with torchbearer_dist.distributed_loader(dataset, batch_size=...) or '
                          'pass sampler=DistributedSampler(dataset)'.format(collectives.world_size()), stacklevel=2)

    def on_start_epoch(self, state):
        for loader in _loaders(state):
            for sampler in _samplers(loader):
                sampler.set_epoch(state[torchbearer.EPOCH])
