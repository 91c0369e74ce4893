"""Gathering variable-length outputs of every rank with fixed-shape collectives: no pickling anywhere.

Each rank holds a tensor whose first dimension (its number of samples) may differ from the others'.
One ``all_gather`` of a small integer header (rows, dtype, shape) tells every rank how much each
holds; one ``all_gather`` of the tensors padded to the longest then moves the data, and the padding
is cut off again. :func:`gather_predictions` also puts the rows back in dataset order.
"""
import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives

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


def all_gather_rows(tensor, device=None):
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order; ranks may hold different row counts.

    Example:

        .. code-block:: python

            # rank 0 holds 3 rows, rank 1 holds 2
            all_gather_rows(torch.randn(3 - rank(), 4)).shape  # (5, 4) on both ranks

    Args:
        tensor (torch.Tensor): this rank's rows (at least one dimension), or None for none; the other
            dimensions and the dtype must be the same on every rank that holds rows
        device (torch.device): where the collectives run; CPU under gloo by default

    Returns:
        tuple: the concatenated tensor (None if no rank held rows) and the list of each rank's row count

    Raises:
        ValueError: the tensor has no dimension or an unsupported dtype (before any collective)
        RuntimeError: the ranks' tensors differ in dtype or in dimensions other than the first

    .. warning:: A synchronization point: every rank must call it.
    """
    header = _header(tensor)
    if collectives.world_size() == 1:
        return tensor, [header[0]]
    device = collectives.comm_device(torch.device('cpu')) if device is None else device
    mine = torch.tensor(header, dtype=torch.int64, device=device)
    headers = [torch.empty_like(mine) for _ in range(collectives.world_size())]
    dist.all_gather(headers, mine)
    headers = [h.tolist() for h in headers]
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
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded)
    origin = tensor.device if tensor is not None else torch.device('cpu')
    return torch.cat([part[:n] for part, n in zip(parts, rows)]).to(origin), rows


def gather_predictions(predictions, indices):
    """Every rank's predictions in dataset order, each sample once: what one process predicting them all returns.

    Example:

        .. code-block:: python

            sampler = DistributedSampler(dataset, shuffle=False)
            mine = model(x_of_my_shard)  # rows for list(sampler)[:len(mine)]
            everything = gather_predictions(mine, list(sampler))

    Args:
        predictions (torch.Tensor): this rank's predictions, one row per sample (None for none)
        indices (list): the dataset index of each row, in order; longer lists are cut to the rows

    Returns:
        torch.Tensor: the rows of all ranks sorted by dataset index, a sample predicted on several
        ranks (a padding sampler repeats some) kept once

    .. warning:: A synchronization point: every rank must call it.
    """
    rows = 0 if predictions is None else predictions.size(0)
    if len(indices) < rows:
        raise ValueError('{} predictions but only {} sample indices; pass the sampler that fed them'.format(
            rows, len(indices)))
    gathered, _ = all_gather_rows(predictions)
    where, _ = all_gather_rows(torch.tensor(list(indices)[:rows], dtype=torch.int64))
    if gathered is None:
        return predictions
    order = torch.argsort(where.to(gathered.device), stable=True)
    where = where[order.cpu()]
    first = torch.ones_like(where, dtype=torch.bool)
    first[1:] = where[1:] != where[:-1]
    return gathered[order[first.to(order.device)]]
