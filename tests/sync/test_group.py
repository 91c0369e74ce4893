"""The group interface every averaging engine takes (``torchbearer_dist.sync.group``), on real gloo ranks.

:class:`HierarchicalGroup` is tried as the fault-tolerant mode uses it, two replica groups of two ranks, with
the across-groups level a real process group of the same rank of each group (the part torchft's quorum plays
there): its sum, average, rank and broadcast must equal the flat group's over the four ranks, whatever the
tensor's length (shares of unequal and of zero length).
"""
import torch
import torch.distributed as dist

from torchbearer_dist.sync.group import AVG, SUM, DistGroup, HierarchicalGroup

from _dist import run_workers


def _two_levels():
    """Ranks {0, 1} and {2, 3} as replica groups; {0, 2} and {1, 3} across them (every rank makes every group)."""
    rank = dist.get_rank()
    local = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    return HierarchicalGroup(DistGroup(local), DistGroup(across))


def _hierarchical_reductions():
    group, rank = _two_levels(), dist.get_rank()
    found = {'size': group.size(), 'rank': group.rank(), 'alone': group.alone()}
    for numel in (1, 3, 8, 1001):  # shares of 0 and 1 value (numel 1, 3), even ones, uneven ones
        values = torch.arange(numel, dtype=torch.float64) * (rank + 1) + rank ** 3
        summed, averaged = values.clone(), values.clone()
        found['sum', numel] = (group.all_reduce(summed, SUM).wait(), summed)
        found['avg', numel] = (group.all_reduce(averaged, AVG).wait(), averaged)
    shared = torch.full((5,), float(rank + 7))
    found['broadcast'] = (group.broadcast(shared).wait(), shared)
    return found


def test_the_hierarchical_group_sums_averages_and_broadcasts_as_one_group_of_every_rank():
    found = run_workers(_hierarchical_reductions, world_size=4)
    assert [f['size'] for f in found] == [4] * 4
    assert [f['rank'] for f in found] == [0, 1, 2, 3]
    assert not any(f['alone'] for f in found)
    for numel in (1, 3, 8, 1001):
        every = [torch.arange(numel, dtype=torch.float64) * (r + 1) + r ** 3 for r in range(4)]
        total = sum(every)  # small integers: exact in float64 whatever the order of the sum
        for f in found:
            assert f['sum', numel][0] is True and torch.equal(f['sum', numel][1], total), (numel, f['sum', numel])
            assert torch.equal(f['avg', numel][1], total / 4), numel
    # the first rank of the first group's values, on every rank
    assert all(f['broadcast'][0] is True and torch.equal(f['broadcast'][1], torch.full((5,), 7.0)) for f in found)


