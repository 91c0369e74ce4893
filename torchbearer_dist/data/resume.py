"""The rest of an epoch: the samples a rank trains when a job resumes in the middle of an epoch, at the same or
another world size."""

from torch.utils.data import DistributedSampler


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
