"""A reshuffle each epoch: ``set_epoch`` on every sharding sampler of the Trial's loaders; and the data sentinel."""
import warnings

import torchbearer
from torchbearer import Callback

from torchbearer_dist.data import check_same_data, describe_search, distributed_samplers
from torchbearer_dist.data.loaders import _samplers
from torchbearer_dist.sync import collectives


def _loaders(state):
    keys = (torchbearer.TRAIN_GENERATOR, torchbearer.VALIDATION_GENERATOR, torchbearer.TEST_GENERATOR)
    return [state[key] for key in keys if state.get(key) is not None]


class SetSamplerEpoch(Callback):
    """Call ``set_epoch(epoch)`` on every DistributedSampler of the Trial's loaders at each epoch start.

    Without it, a shuffling DistributedSampler repeats the same order every epoch. It finds every
    sampler reachable from each loader, also inside a wrapper loader that holds other loaders (see
    :func:`~torchbearer_dist.data.distributed_samplers`). In a world of more than one rank it also
    warns once, on rank 0, when no DistributedSampler is reachable from the training loader: every
    rank would then train on all the data (see :func:`distributed_loader`).

    **Data sentinel.** At the start of every run, ``evaluate()`` and ``predict()``, the ranks compare
    the data they were given (see :func:`~torchbearer_dist.data.check_same_data`): each loader's
    dataset length, the indices of its subsets and a few samples, and the training loader's
    sampler settings and ranks. An unseeded validation split, a different file list on one rank or
    shards that overlap stop every rank before the first step, naming the loader and the likely cause.

    Example: ::

        >>> from torchbearer_dist import SetSamplerEpoch
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[SetSamplerEpoch()])

    Args:
        check_data (bool): run the data sentinel at the start of each run; ``False`` turns it off

    Raises:
        RuntimeError: the data sentinel found data that differs across ranks (on every rank)

    State Requirements:
        - :attr:`torchbearer.state.EPOCH`: the epoch about to start
        - :attr:`torchbearer.state.TRAIN_GENERATOR`: the training loader, checked for a DistributedSampler
        - :attr:`torchbearer.state.VALIDATION_GENERATOR`, :attr:`torchbearer.state.TEST_GENERATOR`: compared

    .. warning:: A synchronization point at the start of each run, with ``check_data``.
    """

    def __init__(self, check_data=True):
        super().__init__()
        if not isinstance(check_data, bool):
            raise ValueError('check_data should be True or False, but given {!r}'.format(check_data))
        self.check_data = check_data
        self._warned = False

    def on_start(self, state):
        if collectives.world_size() == 1:
            return
        if self.check_data:
            check_same_data({'training': state.get(torchbearer.TRAIN_GENERATOR),
                             'validation': state.get(torchbearer.VALIDATION_GENERATOR),
                             'test': state.get(torchbearer.TEST_GENERATOR)})
        loader = state.get(torchbearer.TRAIN_GENERATOR)
        if self._warned or loader is None or distributed_samplers(loader):
            return
        self._warned = True
        if collectives.rank() == 0:
            warnings.warn('no DistributedSampler is reachable from the training loader (looked at {}), so each of the '
                          '{} ranks trains on all of its data; build it with torchbearer_dist.distributed_loader('
                          'dataset, batch_size=...) or pass sampler=DistributedSampler(dataset)'.format(
                              describe_search(loader), collectives.world_size()), stacklevel=2)

    def on_start_epoch(self, state):
        for loader in _loaders(state):
            for sampler in _samplers(loader):
                sampler.set_epoch(state[torchbearer.EPOCH])
