"""Gathering variable-length outputs of every rank with fixed-shape collectives: no pickling anywhere.

Each rank holds a tensor whose first dimension (its number of samples) may differ from the others'.
One ``all_gather`` of a small integer header (rows, dtype, shape) tells every rank how much each
holds; one ``all_gather`` of the tensors padded to the longest then moves the data, and the padding
is cut off again. :func:`gather_predictions` also puts the rows back in dataset order.

Both collectives go through a group of :mod:`torchbearer_dist.sync.group`, the default process group unless
given one, so that the same gather runs over a torchft quorum of replicas; there a gather that torchft failed
raises :class:`IncompleteGather` rather than return some replicas' rows as if they were all.
"""
import torch

from torchbearer_dist.sync.group import WORLD

_MAX_DIMS = 8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _header(tensor):
    if tensor is None:
        return [0, -1, -1] + [0] * _MAX_DIMS
    if tensor.dim() == 0 or tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError('can only gather tensors of 1 to {} dimensions and a dtype among {}, but given shape {} '
                         'and {}; return such tensors from the model'.format(_MAX_DIMS, len(_DTYPES),
                                                                            tuple(tensor.shape), tensor.dtype))
    shape = list(tensor.shape[1:])
    return [tensor.size(0), tensor.dim(), _DTYPES.index(tensor.dtype)] + shape + [0] * (_MAX_DIMS - len(shape))


class IncompleteGather(RuntimeError):
    """A gather over a fault-tolerant group (:class:`~torchbearer_dist.sync.group.QuorumGroup`,
    :class:`~torchbearer_dist.sync.group.HierarchicalGroup`) that torchft failed: no row of it is to be trusted, so
    none is returned (a replica was lost meanwhile; ``should_commit()`` drops the step)."""


def _gathered(group, tensor):
    """``group.all_gather`` of ``tensor`` into a new ``[size, *shape]`` tensor; raises :class:`IncompleteGather`."""
    output = tensor.new_empty((group.size(),) + tuple(tensor.shape))
    if not group.all_gather(output, tensor).wait():
        raise IncompleteGather('a gather over the live replicas was not whole (torchft failed it: a replica was lost '
                               'meanwhile), so nothing gathered is returned; gather again in the next quorum')
    return output


def all_gather_rows(tensor, device=None, group=None):
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order; ranks may hold different row counts.

    Example:

        .. code-block:: python

            # rank 0 holds 3 rows, rank 1 holds 2
            all_gather_rows(torch.randn(3 - rank(), 4)).shape  # (5, 4) on both ranks

    Args:
        tensor (torch.Tensor): this rank's rows (at least one dimension), or None for none; the other
            dimensions and the dtype must be the same on every rank that holds rows
        device (torch.device): where the collectives run; by default the group's (the CPU under gloo)
        group: whose rows (a group of :mod:`torchbearer_dist.sync.group`), in the order of their ``rank()``, through
            that group's collectives (a header, then the rows padded to the longest); None: the default process
            group. A replica outside the quorum (``rank()`` None) receives the others' rows and sends none

    Returns:
        tuple: the concatenated tensor (None if no rank held rows) and the list of each rank's row count

    Raises:
        ValueError: the tensor has no dimension or an unsupported dtype (before any collective)
        RuntimeError: the ranks' tensors differ in dtype or in dimensions other than the first
        ~torchbearer_dist.sync.gather.IncompleteGather: a RuntimeError: torchft failed a collective of the gather (a
            fault-tolerant group only); never a partial result. Every rank of a replica group raises it alike

    .. warning:: A synchronization point: every rank must call it.
    """
    group = WORLD if group is None else group
    header = _header(tensor)
    if group.alone():
        return tensor, [header[0]]
    device = group.device() if device is None else device
    headers = _gathered(group, torch.tensor(header, dtype=torch.int64, device=device)).tolist()
    rows = [h[0] for h in headers]
    held = [h[1:] for h in headers if h[1] >= 0]
    if not held:
        return None, rows
    if any(h != held[0] for h in held):
        raise RuntimeError('ranks hold outputs of different shapes or dtypes (this rank: {}); every rank must return '
                           'rows of the same shape and dtype'.format(
                               None if tensor is None else '{} {}'.format(tuple(tensor.shape), tensor.dtype)))
    ndim, dtype = held[0][0], _DTYPES[held[0][1]]
    shape = held[0][2:2 + ndim - 1]
    padded = torch.zeros([max(rows)] + shape, dtype=dtype, device=device)
    if tensor is not None and tensor.size(0):
        padded[:tensor.size(0)] = tensor.detach().to(device)
    parts = _gathered(group, padded)
    origin = tensor.device if tensor is not None else torch.device('cpu')
    return torch.cat([part[:n] for part, n in zip(parts, rows)]).to(origin), rows


def gather_predictions(predictions, indices, group=None):
    """Every rank's predictions in dataset order, each sample once: what one process predicting them all returns.

    Example:

        .. code-block:: python

            sampler = DistributedSampler(dataset, shuffle=False)
            mine = model(x_of_my_shard)  # rows for list(sampler)[:len(mine)]
            everything = gather_predictions(mine, list(sampler))

    Args:
        predictions (torch.Tensor): this rank's predictions, one row per sample (None for none)
        indices (list): the dataset index of each row, in order; longer lists are cut to the rows
        group: whose predictions (a group of :mod:`torchbearer_dist.sync.group`), through that group's
            collectives; None: the default process group

    Returns:
        torch.Tensor: the rows of all ranks sorted by dataset index, a sample predicted on several
        ranks (a padding sampler repeats some) kept once

    Raises:
        ValueError: more predictions than indices (before any collective)
        ~torchbearer_dist.sync.gather.IncompleteGather: a RuntimeError: torchft failed a collective of the gather
            (see :func:`all_gather_rows`): never predictions with some replicas' rows missing

    .. warning:: A synchronization point: every rank must call it.
    """
    rows = 0 if predictions is None else predictions.size(0)
    if len(indices) < rows:
        raise ValueError('{} predictions but only {} sample indices; pass the sampler that fed them'.format(
            rows, len(indices)))
    gathered, _ = all_gather_rows(predictions, group=group)
    where, _ = all_gather_rows(torch.tensor(list(indices)[:rows], dtype=torch.int64), group=group)
    if gathered is None:
        return predictions
    order = torch.argsort(where.to(gathered.device), stable=True)
    where = where[order.cpu()]
    first = torch.ones_like(where, dtype=torch.bool)
    first[1:] = where[1:] != where[:-1]
    return gathered[order[first.to(order.device)]]
