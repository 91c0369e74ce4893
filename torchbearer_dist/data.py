"""Data across ranks: a correctly sharded loader, and finding the sampler that shards one."""
from torch.utils.data import DataLoader, DistributedSampler

from torchbearer_dist.sync import collectives


def _samplers(loader):
    found = []
    for sampler in (getattr(loader, 'sampler', None), getattr(getattr(loader, 'batch_sampler', None), 'sampler', None)):
        if sampler is not None and hasattr(sampler, 'set_epoch') and sampler not in found:
            found.append(sampler)
    return found


def distributed_sampler(loader):
    """The sampler of ``loader`` that shards the data over ranks (a DistributedSampler), or None.

    Args:
        loader: a DataLoader (or anything with ``sampler`` / ``batch_sampler`` attributes)

    Returns:
        torch.utils.data.DistributedSampler: the loader's sharding sampler, or None
    """
    candidates = (getattr(loader, 'sampler', None), getattr(loader, 'batch_sampler', None),
                  getattr(getattr(loader, 'batch_sampler', None), 'sampler', None))
    for sampler in candidates:
        if isinstance(sampler, DistributedSampler) or hasattr(sampler, 'num_replicas') and hasattr(sampler, 'rank'):
            return sampler
    return None


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
