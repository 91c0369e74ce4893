"""Sharded loaders: :func:`distributed_loader`, and the samplers that shard a loader, found inside wrapper loaders."""

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from torchbearer_dist.sync import collectives


def _is_sharding(sampler):
    return isinstance(sampler, DistributedSampler) or hasattr(sampler, 'num_replicas') and hasattr(sampler, 'rank')


def _looks_like_loader(value):
    return isinstance(value, DataLoader) or hasattr(value, 'sampler') or hasattr(value, 'batch_sampler')


def _reachable(loader, depth=4):
    """Every sampler and loader reachable from ``loader``: its own, and those of loaders it holds (in attributes,
    lists, tuples or dicts), depth first, each once. Datasets are not searched."""
    samplers, loaders, seen = [], [], set()

    def visit(value, depth):
        if value is None or id(value) in seen or depth < 0 or isinstance(value, (str, bytes, torch.Tensor)):
            return
        seen.add(id(value))
        if isinstance(value, Sampler) or hasattr(value, 'set_epoch') and not _looks_like_loader(value):
            samplers.append(value)
            inner = getattr(value, 'sampler', None)  # a BatchSampler around a sampler
            if inner is not None:
                visit(inner, depth - 1)
            return
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth - 1)
            return
        if isinstance(value, dict):
            for item in value.values():
                visit(item, depth - 1)
            return
        if _looks_like_loader(value):
            loaders.append(value)
            for name in ('sampler', 'batch_sampler'):
                visit(getattr(value, name, None), depth - 1)
        if isinstance(value, DataLoader):
            return  # a DataLoader's other attributes are its dataset and settings
        attributes = getattr(value, '__dict__', None)
        if isinstance(attributes, dict):
            for name, item in attributes.items():
                if name != 'dataset' and (_looks_like_loader(item) or isinstance(item, (Sampler, list, tuple, dict))):
                    visit(item, depth - 1)

    visit(loader, depth)
    return samplers, loaders


def _samplers(loader):
    """Every sampler with ``set_epoch`` reachable from ``loader``, wrapper loaders included."""
    return [s for s in _reachable(loader)[0] if hasattr(s, 'set_epoch')]


def distributed_samplers(loader):
    """Every sampler that shards data over ranks (a DistributedSampler) reachable from ``loader``.

    Looks at the loader's ``sampler`` and ``batch_sampler`` (and the sampler inside a batch
    sampler), and at the loaders that a wrapper loader holds in its attributes, lists, tuples or
    dicts (a loader that zips two DataLoaders, each with its own DistributedSampler), a few levels
    deep; datasets are not searched.

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
