"""Sharded loaders: :func:`distributed_loader`, and the samplers that shard a loader, found inside wrapper loaders."""

import functools
import hashlib
import types

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from torchbearer_dist.sync import collectives

#: How many objects one search looks at, at most: a bound on its cost whatever the loader holds.
_BUDGET = 2000
#: How many items of one list, tuple, set or dict it looks at: a wrapper holds a few loaders, not thousands.
_ITEMS = 64
#: Objects of these modules are machinery (worker processes, queues, threads, sockets, groups), never a loader.
_MACHINERY = ('multiprocessing', 'threading', 'queue', 'concurrent', 'socket', 'selectors', 'subprocess', 'logging',
              'weakref', 'io', '_io', 'torch.distributed', 'torch._C')
_OPAQUE = (str, bytes, bytearray, int, float, complex, torch.Tensor, torch.Generator, Dataset, nn.Module, type,
           types.ModuleType, types.CodeType, types.FrameType)


def _is_sharding(sampler):
    return isinstance(sampler, DistributedSampler) or hasattr(sampler, 'num_replicas') and hasattr(sampler, 'rank')


def _looks_like_loader(value):
    return isinstance(value, DataLoader) or hasattr(value, 'sampler') or hasattr(value, 'batch_sampler')


@functools.lru_cache(maxsize=1024)
def _is_machinery_module(module):
    return any(module == name or module.startswith(name + '.') for name in _MACHINERY)


def _is_machinery(value):
    module = getattr(type(value), '__module__', None)
    return isinstance(module, str) and _is_machinery_module(module)


def _reachable(loader, depth=6, deep=False):
    """Every sampler and loader reachable from ``loader``, depth first, each once: found by what objects hold.

    A loader that holds its own sampler (a DataLoader whose ``__init__`` ran) is searched through its
    sampler, its batch sampler and its public attributes; any other object (a wrapper, a DataLoader
    subclass that never ran ``DataLoader.__init__``, an iterator of a loader) through all of its
    attributes, lists, tuples, sets and dicts. Datasets, tensors, models and process machinery are
    not searched. With ``deep``, also what functions hold in their closures (and partials and bound
    methods hold) and the local variables of a generator: where a loader built inside a function
    keeps its sampler. At most :data:`_BUDGET` objects are looked at.
    """
    samplers, loaders, seen = [], [], set()
    budget = [_BUDGET]

    def visit(value, depth):
        if value is None or id(value) in seen or depth < 0 or budget[0] <= 0 or isinstance(value, _OPAQUE) \
                or _is_machinery(value):
            return
        seen.add(id(value))
        budget[0] -= 1
        if isinstance(value, Sampler) or hasattr(value, 'set_epoch') and not _looks_like_loader(value):
            samplers.append(value)
            inner = getattr(value, 'sampler', None)  # a BatchSampler around a sampler
            if inner is not None:
                visit(inner, depth - 1)
            return
        if isinstance(value, dict):
            items = list(value.values())[:_ITEMS]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)[:_ITEMS]
        elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial, types.GeneratorType)):
            items = _held_by_code(value) if deep else []
        else:
            items = None
        if items is not None:
            for item in items:
                visit(item, depth - 1)
            return
        attributes = getattr(value, '__dict__', None)
        attributes = attributes if isinstance(attributes, dict) else {}
        holds_sampler = 'sampler' in attributes or 'batch_sampler' in attributes
        if _looks_like_loader(value) and (holds_sampler or not isinstance(value, DataLoader)):
            loaders.append(value)
            for name in ('sampler', 'batch_sampler'):
                visit(getattr(value, name, None), depth - 1)
        elif isinstance(value, DataLoader):  # its __init__ never ran: a wrapper by what it holds
            loaders.append(value)
        for name, item in list(attributes.items()):
            if name != 'dataset' and not (holds_sampler and name.startswith('_')):
                visit(item, depth - 1)

    visit(loader, depth)
    return samplers, loaders


def _held_by_code(value):
    """What a function's closure, a partial, a bound method or a suspended generator's local variables hold."""
    if isinstance(value, types.MethodType):
        return [value.__self__, value.__func__]
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        return list(frame.f_locals.values()) if frame is not None else []
    held = list(value.__defaults__ or ())
    for cell in value.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            pass
    return held


def _reachable_deep(*roots):
    """Every sampler reachable from any of ``roots`` (a loader, its live iterator), closures included, each once."""
    found, seen = [], set()
    for root in roots:
        for sampler in _reachable(root, deep=True)[0]:
            if id(sampler) not in seen:
                seen.add(id(sampler))
                found.append(sampler)
    return found


_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _order_print(sampler):
    """What determines the order ``sampler`` gives this epoch, read without drawing from any generator, or None.

    A shuffling DistributedSampler (torch's own ``__iter__``) draws its permutation from a generator
    seeded with ``seed + epoch``: that sum is the order's fingerprint, exact even for a dataset of two
    samples, whose permutations often coincide. torch's random samplers draw from their own generator,
    or without one from torch's global generator: the fingerprint of that generator's state. A
    sampler that does not shuffle, or whose ``__iter__`` the package does not know (it might draw
    from a generator: iterating it could change training), gives None: it is not checked.
    """
    if isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__:
        return ('seed + epoch', sampler.seed + sampler.epoch) if sampler.shuffle else None
    for kind in _RANDOM_SAMPLERS:
        if isinstance(sampler, kind) and type(sampler).__iter__ is kind.__iter__:
            generator = getattr(sampler, 'generator', None)
            state = generator.get_state() if generator is not None else torch.random.get_rng_state()
            # A digest, not a sum of words: one draw moves two counters of the state by +n and -n.
            return ('generator' if generator is not None else 'global generator',
                    hashlib.sha256(state.numpy().tobytes()).hexdigest())
    return None


def _samplers(loader):
    """Every sampler with ``set_epoch`` reachable from ``loader``, wrapper loaders included."""
    return [s for s in _reachable(loader)[0] if hasattr(s, 'set_epoch')]


def distributed_samplers(loader):
    """Every sampler that shards data over ranks (a DistributedSampler) reachable from ``loader``.

    Samplers are found by what objects hold, not by their class: a loader's ``sampler`` and
    ``batch_sampler`` (and the sampler inside a batch sampler), and whatever a wrapper holds in its
    attributes, lists, tuples or dicts, a few levels deep: a loader that zips two DataLoaders, each
    with its own DistributedSampler, is searched like this even when it subclasses DataLoader without
    running ``DataLoader.__init__`` (torchbearer's custom_loaders notebook), and so are the loaders'
    iterators it keeps. Datasets, tensors and models are not searched.

    Example: ::

        >>> from torch.utils.data import DataLoader, DistributedSampler
        >>> from torch.utils.data import TensorDataset
        >>> from torchbearer_dist.data import distributed_samplers
        >>> data = TensorDataset(torch.randn(8, 2))
        >>> def sharded():
        ...     sampler = DistributedSampler(data, num_replicas=1, rank=0)
        ...     return DataLoader(data, sampler=sampler)
        >>> class Zip:
        ...     def __init__(self, *loaders):
        ...         self.loaders = loaders
        >>> zipped = Zip(sharded(), sharded())
        >>> len(distributed_samplers(zipped))
        2

    Args:
        loader: a DataLoader, a wrapper around loaders, or any iterable

    Returns:
        list: the sharding samplers, in the order found (empty when none is reachable)
    """
    return [s for s in _reachable(loader)[0] if _is_sharding(s)]


def distributed_sampler(loader):
    """The first sampler reachable from ``loader`` that shards the data over ranks (a DistributedSampler), or None.

    Args:
        loader: a DataLoader, a wrapper around loaders (see :func:`distributed_samplers`), or any iterable

    Returns:
        torch.utils.data.DistributedSampler: the loader's sharding sampler, or None
    """
    found = distributed_samplers(loader)
    return found[0] if found else None


def describe_search(loader):
    """What :func:`distributed_samplers` looked at in ``loader``, for a message: its loaders and samplers."""
    samplers, loaders = _reachable(loader)
    names = [type(x).__name__ for x in loaders + samplers]
    if not names:
        return 'a {} that holds no loader or sampler'.format(type(loader).__name__)
    return ', '.join(names)


def distributed_loader(dataset, batch_size=1, shuffle=False, seed=0, drop_last=False, **loader_kwargs):
    """A DataLoader over this rank's shard of ``dataset``: a DistributedSampler in a world of more than one rank.

    ``batch_size`` is per rank, as everywhere in torchbearer_dist and in DataLoader itself: N ranks at
    ``batch_size=B`` train like one process at N x B. (Ignite's ``auto_dataloader``, the model for this
    helper, divides a global batch size instead; here the number a user types means what it means in a
    plain DataLoader.) The sampler is a DistributedSampler in a job of one process too: its permutation
    for one rank at N x B is then, batch for batch, the union of the N ranks' batches. Every sample is seen: the
    sampler pads the shards to equal length by repeating a few samples, which
    :class:`~torchbearer_dist.ReduceMetrics` drops again in validation and prediction. Add
    :class:`SetSamplerEpoch` (in :func:`~torchbearer_dist.distributed_callbacks`) to reshuffle each epoch.

    Example: ::

        >>> from torch.utils.data import TensorDataset
        >>> from torchbearer_dist import distributed_loader
        >>> dataset = TensorDataset(torch.randn(10, 2))
        >>> loader = distributed_loader(dataset, batch_size=4, shuffle=True)
        >>> len(loader)  # one process: all 10 samples
        3

    Args:
        dataset (torch.utils.data.Dataset): the whole dataset, the same on every rank
        batch_size (int): samples per batch on each rank
        shuffle (bool): shuffle (the same permutation on every rank, new each epoch under SetSamplerEpoch)
        seed (int): seed of the shuffle, the same on every rank
        drop_last (bool): drop each rank's last incomplete batch
        **loader_kwargs: any other DataLoader argument (``num_workers``, ``collate_fn``, ``pin_memory``, ...)

    Returns:
        torch.utils.data.DataLoader: the loader of this rank's shard

    Raises:
        ValueError: ``batch_size`` is not a positive integer, or ``sampler`` / ``batch_sampler`` is passed
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError('batch_size should be an integer >= 1 (samples per rank), but given {!r}'.format(batch_size))
    for name in ('sampler', 'batch_sampler'):
        if loader_kwargs.get(name) is not None:
            raise ValueError('distributed_loader builds its own sampler, but given {}={!r}; build the DataLoader '
                             'yourself with a DistributedSampler instead'.format(name, loader_kwargs[name]))
    sampler = DistributedSampler(dataset, num_replicas=collectives.world_size(), rank=collectives.rank(),
                                 shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
