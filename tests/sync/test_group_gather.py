"""``all_gather`` of the group interface (``torchbearer_dist.sync.group``), on real gloo ranks.

Every group stacks each member's tensor at the member's rank, bit for bit, in every dtype of ``GATHER_DTYPES``:
:class:`DistGroup` through ``dist.all_gather``, :class:`HierarchicalGroup` (two replica groups of two ranks, the
across-groups level a real process group, as in ``test_group.py``) through a sum of a table of zeros. Over real
torchft replicas: ``tests/callbacks/test_metrics_over_replicas.py``.
"""
import pytest
import torch
import torch.distributed as dist
from _manager import StandInManager
from test_group import _two_levels

from torchbearer_dist.sync.gather import IncompleteGather, all_gather_rows, gather_predictions
from torchbearer_dist.sync.group import GATHER_DTYPES, DistGroup, QuorumGroup

from _dist import run_workers


def _values(rank, dtype, shape=(2, 3)):
    """Rank ``rank``'s values: distinct per rank and element, a -0.0-free mix of signs where the dtype has them."""
    base = torch.arange(6, dtype=torch.float64).reshape(shape) * (rank + 1) + 3 * rank
    if dtype == torch.bool:
        return (base.long() % 3 == rank % 2).reshape(shape)
    if dtype.is_complex:
        return torch.complex(base - 4, base * 0.5).to(dtype)
    if dtype.is_floating_point:
        return ((base - 5) * 0.25).to(dtype)
    return (base - (5 if dtype != torch.uint8 else 0)).to(dtype)


def _gather_every_dtype(group):
    found = {}
    for dtype in GATHER_DTYPES:
        mine = _values(group.rank(), dtype)
        output = torch.empty(group.size(), *mine.shape, dtype=dtype)
        found[dtype] = (group.all_gather(output, mine).wait(), output)
    return found


def _flat():
    return _gather_every_dtype(DistGroup())


def _hierarchical():
    return _gather_every_dtype(_two_levels())


@pytest.mark.timeout(120)
@pytest.mark.parametrize('ranks, worker', [(2, _flat), (4, _hierarchical)], ids=['DistGroup', 'HierarchicalGroup'])
def test_all_gather_stacks_every_members_tensor_at_its_rank_bit_for_bit_in_every_dtype(ranks, worker):
    for found in run_workers(worker, world_size=ranks):
        for dtype in GATHER_DTYPES:
            whole, output = found[dtype]
            expected = torch.stack([_values(r, dtype) for r in range(ranks)])
            assert whole is True and output.dtype == dtype and torch.equal(output, expected), (dtype, output)


def test_a_group_of_one_gathers_its_own_tensor_without_a_process_group():
    mine = torch.tensor([1.5, -2.0])
    output = torch.empty(1, 2)
    assert DistGroup().all_gather(output, mine).wait() is True and torch.equal(output, mine[None])


def test_an_output_that_does_not_fit_or_a_dtype_no_group_carries_is_refused_before_any_collective():
    with pytest.raises(ValueError, match=r'^all_gather needs a contiguous output of shape \(1, 2\) and dtype '
                                         r'torch.float32 \(size\(\) rows of the tensor\), but given \(2, 2\) '
                                         r'torch.float32; allocate it as torch.empty\(size\(\), \*tensor.shape, '
                                         r'dtype=tensor.dtype\)$'):
        DistGroup().all_gather(torch.empty(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match=r'but given \(1, 2\) torch.float64; '):
        DistGroup().all_gather(torch.empty(1, 2, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match=r'^all_gather takes a tensor of a dtype among float64, .*, but given '
                                         r'torch.uint16; convert it first$'):
        DistGroup().all_gather(torch.empty(1, 2, dtype=torch.uint16), torch.zeros(2, dtype=torch.uint16))


def test_a_quorum_gathers_by_a_sum_of_its_members_rows_and_one_outside_it_sends_none():
    other = torch.tensor([[0, 0], [7, 8]], dtype=torch.uint8)  # the other replica's row 1
    manager = StandInManager(rank=0, others=[other])
    output = torch.empty(2, 2, dtype=torch.bool)
    assert QuorumGroup(manager).all_gather(output, torch.tensor([True, False])).wait() is True
    assert torch.equal(manager.sent[0], torch.tensor([[1, 0], [0, 0]], dtype=torch.uint8))  # its row, zeros else
    assert torch.equal(output, torch.tensor([[True, False], [True, True]]))
    outside = StandInManager(rank=None)
    QuorumGroup(outside).all_gather(torch.empty(2, 3), torch.ones(3)).wait()
    assert not outside.sent[0].any()


def test_a_gather_torchft_failed_says_so():
    group = QuorumGroup(StandInManager(error=RuntimeError('peer lost')))
    assert group.all_gather(torch.empty(2, 1), torch.ones(1)).wait() is False


def test_a_quorum_that_counts_only_the_replicas_that_trained_refuses_a_gather():
    group = QuorumGroup(StandInManager(others=[torch.tensor([0.0, 1.0], dtype=torch.float64)]), trained=True)
    with pytest.raises(ValueError, match=r'^all_gather gathers every live replica, but this QuorumGroup counts only '
                                         r'those that trained \(trained=True\); gather over QuorumGroup\(manager\)$'):
        group.all_gather(torch.empty(2, 1), torch.ones(1))


def _rows_over_groups():
    """Ranks holding 2, none, 3 and 1 rows (a sampler's shards, dataset index ``rank + 4 * i``), gathered over the
    two replica groups of two and over the flat group of the four ranks."""
    rank, found = dist.get_rank(), {}
    rows = [2, 0, 3, 1][rank]
    mine = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * rank if rows else None
    indices = [rank + 4 * i for i in range(rows)]
    for name, group in (('hierarchical', _two_levels()), ('flat', None)):
        found[name] = all_gather_rows(mine, group=group), gather_predictions(mine, indices, group=group)
    return found


@pytest.mark.timeout(120)
def test_rows_and_predictions_gathered_over_replica_groups_equal_those_over_the_flat_group():
    for found in run_workers(_rows_over_groups, world_size=4):
        (rows, counts), predictions = found['hierarchical']
        (flat_rows, flat_counts), flat_predictions = found['flat']
        assert counts == flat_counts == [2, 0, 3, 1]
        assert torch.equal(rows, flat_rows) and rows.shape == (6, 3)
        assert torch.equal(predictions, flat_predictions) and predictions[:, 0].tolist() == [
            0.0, 200.0, 300.0, 3.0, 203.0, 206.0]  # dataset order: 0, 2, 3, 4, 6, 10 (ranks 0, 2, 3, 0, 2, 2)


def test_a_gather_torchft_failed_raises_instead_of_returning_some_replicas_rows():
    manager = StandInManager(error=RuntimeError('peer lost'))
    with pytest.raises(IncompleteGather, match=r'^a gather over the live replicas was not whole \(torchft failed it: '
                                               r'a replica was lost meanwhile\), so nothing gathered is returned; '
                                               r'gather again in the next quorum$'):
        gather_predictions(torch.ones(2, 1), [0, 2], group=QuorumGroup(manager))
    assert len(manager.sent) == 1  # the header's gather, and nothing after it
