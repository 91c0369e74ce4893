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


def _epoch_order(sampler, world_size):
    """One epoch of ``sampler``'s DistributedSampler order at ``world_size`` ranks, as one global list.

    Rank ``r``'s ``j``-th sample is entry ``j * world_size + r``, so the first ``world_size * n`` entries are
    exactly what every rank has seen after ``n`` samples each. Built with torch's own DistributedSampler.
    """
    shards = []
    for r in range(world_size):
        shard = DistributedSampler(sampler.dataset, num_replicas=world_size, rank=r, shuffle=sampler.shuffle,
                                   seed=sampler.seed, drop_last=sampler.drop_last)
        shard.set_epoch(sampler.epoch)
        shards.append(list(shard))
    return [shards[r][j] for j in range(len(shards[0])) for r in range(world_size)]


def resumable(sampler):
    """Whether :func:`remaining_indices` can continue ``sampler``'s epoch: a plain torch DistributedSampler."""
    return type(sampler) is DistributedSampler


def remaining_indices(sampler, samples_done, world_size):
    """This rank's share of the samples of the current epoch not yet seen, for a resume in mid-epoch.

    ``samples_done`` samples per rank were trained at ``world_size`` ranks, in the order of ``sampler``
    (a torch DistributedSampler, at the epoch set by ``set_epoch``). At the same world size the result
    is exactly the rest of this rank's shard, so the epoch goes on bit for bit. At another world size
    the samples no rank has seen are resharded over the ranks now (padded by repeating a few of them,
    or trimmed under ``drop_last``, as DistributedSampler does).

    Args:
        sampler (torch.utils.data.DistributedSampler): this rank's sampler, at the interrupted epoch
        samples_done (int): samples each rank had trained this epoch
        world_size (int): the world size that trained them

    Returns:
        list: the dataset indices this rank trains in the rest of the epoch, in order
    """
    order = _epoch_order(sampler, world_size)
    done = world_size * min(samples_done, len(order) // world_size)
    if world_size == sampler.num_replicas:
        return order[done:][sampler.rank::sampler.num_replicas]
    rest = order[done:] if sampler.drop_last else order[done:max(done, len(sampler.dataset))]
    ranks = sampler.num_replicas
    if sampler.drop_last:
        rest = rest[:len(rest) - len(rest) % ranks]
    elif rest and len(rest) % ranks:
        padding = ranks - len(rest) % ranks
        rest = rest + (rest * (padding // len(rest) + 1))[:padding]
    return rest[sampler.rank::ranks]
