"""A reshuffle each epoch: ``set_epoch`` on every sharding sampler of the Trial's loaders; the data and order
sentinels."""
import warnings

import torchbearer
from torch.utils.data import DistributedSampler
from torchbearer import Callback

from torchbearer_dist.data import check_same_data, describe_search, distributed_samplers
from torchbearer_dist.data.loaders import _is_sharding, _order_print, _reachable_deep, _samplers
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

    **Order sentinel.** At the start of each training pass every rank reads what determines the order
    of each shuffling sampler reachable from the training loader and from its iterator, also inside
    closures and generators where ``set_epoch`` cannot reach it: a DistributedSampler's
    ``seed + epoch``, the state of the generator a RandomSampler draws from (no sample is drawn, no
    generator advanced). One that gives the previous epoch's order again (its ``set_epoch`` was missed)
    stops every rank before the epoch's first step, naming the loader and the sampler. Samplers that
    do not shuffle, and samplers the package does not know, are not checked.

    Example: ::

        >>> from torchbearer_dist import SetSamplerEpoch
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[SetSamplerEpoch()])

    Args:
        check_data (bool): run the data sentinel at the start of each run; ``False`` turns it off
        check_order: what a shuffling training sampler that repeats the previous epoch's order does:
            ``'raise'`` stops every rank, ``'warn'`` warns once per run on rank 0 (the repetition is
            intended), ``False`` turns the order sentinel off

    Raises:
        ValueError: ``check_data`` or ``check_order`` is not one of its values
        RuntimeError: the data sentinel found data that differs across ranks, or the order sentinel a
            repeated order (on every rank)

    State Requirements:
        - :attr:`torchbearer.state.EPOCH`: the epoch about to start
        - :attr:`torchbearer.state.TRAIN_GENERATOR`: the training loader, checked for a DistributedSampler
        - :attr:`torchbearer.state.VALIDATION_GENERATOR`, :attr:`torchbearer.state.TEST_GENERATOR`: compared

    .. warning:: A synchronization point at the start of each run, with ``check_data``, and of each
        training pass after the first of a run, with ``check_order``.
    """

    def __init__(self, check_data=True, check_order='raise'):
        super().__init__()
        if not isinstance(check_data, bool):
            raise ValueError('check_data should be True or False, but given {!r}'.format(check_data))
        if check_order not in ('raise', 'warn') and check_order is not False:
            raise ValueError("check_order should be 'raise', 'warn' or False, but given {!r}".format(check_order))
        self.check_data = check_data
        self.check_order = check_order
        self._warned = self._order_warned = False
        self._orders = None  # this run's previous training pass: (epoch, [(sampler class, order print)])

    def on_start(self, state):
        self._orders, self._order_warned = None, False
        if collectives.world_size() == 1:
            return
        if self.check_data:
            check_same_data({'training': state.get(torchbearer.TRAIN_GENERATOR),
                             'validation': state.get(torchbearer.VALIDATION_GENERATOR),
                             'test': state.get(torchbearer.TEST_GENERATOR)})
        loader = state.get(torchbearer.TRAIN_GENERATOR)
        if self._warned or loader is None or distributed_samplers(loader) \
                or any(_is_sharding(s) for s in _reachable_deep(loader)):
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

    def on_start_training(self, state):
        if self.check_order is False or collectives.world_size() == 1:
            return
        loader = state.get(torchbearer.TRAIN_GENERATOR)
        samplers = _reachable_deep(loader, state.get(torchbearer.ITERATOR)) if loader is not None else []
        shuffling = [(s, p) for s, p in ((s, _order_print(s)) for s in samplers) if p is not None]
        prints = [(type(s).__name__, p) for s, p in shuffling]
        previous, self._orders = self._orders, (state[torchbearer.EPOCH], prints)
        if previous is None:
            return
        repeated = 0  # 1 + the position of the first sampler whose order repeats, where the same samplers were found
        if [name for name, _ in previous[1]] == [name for name, _ in prints]:
            repeated = next((i + 1 for i, (old, new) in enumerate(zip(previous[1], prints)) if old == new), 0)
        repeated = collectives.reduce_int(repeated, 'max')  # every rank stops, or none
        if not repeated:
            return
        sampler = shuffling[repeated - 1][0] if repeated <= len(shuffling) else None
        self._repeated(loader, sampler, previous[0], state[torchbearer.EPOCH])

    def _repeated(self, loader, sampler, previous, epoch):
        if isinstance(sampler, DistributedSampler):
            why = 'its epoch is still {}: set_epoch was not called'.format(sampler.epoch)
        else:
            generator = 'its generator' if getattr(sampler, 'generator', None) is not None else \
                "torch's global generator, which it draws from,"
            why = '{} is in the same state as then'.format(generator)
        text = "the training loader ({}) repeats epoch {}'s sample order in epoch {}: its {} shuffles but was not " \
               'reshuffled ({})'.format(type(loader).__name__, previous, epoch,
                                         type(sampler).__name__ if sampler is not None else 'sampler', why)
        if self.check_order == 'raise':
            raise RuntimeError(text + '; call set_epoch(epoch) on the sampler at each epoch start, hold it where '
                               "SetSamplerEpoch finds it (the loader's sampler, or an attribute of the loader), or "
                               "build the loader with torchbearer_dist.distributed_loader; pass check_order='warn' "
                               '(to distributed_callbacks() or SetSamplerEpoch) if the repetition is intended')
        if not self._order_warned and collectives.rank() == 0:
            warnings.warn(text + "; training goes on, as check_order='warn' asks", stacklevel=3)
        self._order_warned = True
