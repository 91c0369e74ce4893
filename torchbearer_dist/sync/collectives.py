"""Small collectives on fixed-shape tensors: rank, world size, flags, counts and metric means.

Nothing here pickles: names, counts, metrics and flags all travel as fixed-shape tensors. The
bucketed gradient all-reduce lives in :mod:`torchbearer_dist.sync.buckets`.
"""
import hashlib

import torch
import torch.distributed as dist

from torchbearer_dist.sync.group import SUM, WORLD

_NAME_BYTES = 200


def world_size():
    """Number of processes in the default group, 1 outside one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank():
    """Rank of this process in the default group, 0 outside one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def comm_device(device):
    """Where small control tensors live: the model's CUDA device under nccl, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == 'nccl':
        return device if device.type == 'cuda' else torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')


def _hash(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], 'big')


def _max_and_min(values, device):
    """One MAX all-reduce that yields both the maximum and the minimum of each value over ranks."""
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.tolist()
    n = len(values)
    return both[:n], [-v for v in both[n:]]


def _wire_text(text):
    """``text`` as :func:`_broadcast_text` delivers it: at most ``_NAME_BYTES`` bytes, no trailing space."""
    return text.encode()[:_NAME_BYTES].decode(errors='replace').rstrip()


def _broadcast_text(text, src, device):
    data = text.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b' ')
    tensor = torch.tensor(list(data), dtype=torch.uint8, device=device)
    dist.broadcast(tensor, src)
    return bytes(tensor.tolist()).decode(errors='replace').rstrip()


def weighted_means(values, weight, device=None, group=None):
    """Average scalar metrics over ranks, each rank weighted by ``weight`` (its sample count).

    One all-reduce, over any group of :mod:`torchbearer_dist.sync.group` (the fail-fast mode's process group, a
    torchft quorum's live replicas, a hierarchical group of replica groups), which also carries each member's
    count and fingerprint of the names, so that every member finds a difference alike.

    Example:

        .. code-block:: python

            # rank 0 saw 100 samples at acc 0.9, rank 1 saw 50 at acc 0.6
            weighted_means({'acc': 0.9}, 100)  # {'acc': 0.8} on both ranks

    Args:
        values (dict): metric name to a number or 0-d tensor; every rank must pass the same names
        weight (float): this rank's weight, e.g. its number of samples; 0 leaves it out
        device (torch.device): where the reduction runs (by default the group's: CPU for gloo)
        group (DistGroup or QuorumGroup or HierarchicalGroup): whom to average over; None: the default process
            group

    Returns:
        dict: the same names mapped to floats, identical on every rank. A rank with weight 0
        contributes nothing; if every weight is 0, the plain mean is used. Where the group could not complete the
        reduction (a torchft quorum that lost a replica meanwhile), each rank's own values.

    Raises:
        RuntimeError: the ranks hold different metric names

    .. warning:: A synchronization point: every rank must call it with the same names.
    """
    group = WORLD if group is None else group
    names = sorted(values)
    numbers = [float(values[name]) for name in names]
    own = dict(zip(names, numbers))
    if group.alone() or not names:
        return own
    device = group.device() if device is None else device
    n, size, me = len(names), group.size(), group.rank()
    payload = torch.zeros(2 * n + 2 + 2 * size, dtype=torch.float64, device=device)
    payload[:2 * n + 2] = torch.tensor([v * weight for v in numbers] + numbers + [float(weight), 1.0],
                                       dtype=torch.float64)
    if me is not None:  # a member outside the count (a torchft replica not participating) sends zeros
        row = [n, _hash('\n'.join(names)) >> 8]  # 48 bits: exact in float64
        payload[2 * n + 2 + 2 * me:2 * n + 4 + 2 * me] = torch.tensor(row, dtype=torch.float64)
    if not group.all_reduce(payload, SUM).wait():
        return own
    payload = payload.tolist()
    rows = {tuple(payload[2 * n + 2 + 2 * i:2 * n + 4 + 2 * i]) for i in range(size)}
    if len(rows) > 1:
        raise RuntimeError('ranks report different metrics ({} here: {}); give every rank the same metrics'.format(
            n, ', '.join(names)))
    total_weight, ranks = payload[2 * n], payload[2 * n + 1]
    if total_weight > 0:
        return {name: payload[i] / total_weight for i, name in enumerate(names)}
    return {name: payload[n + i] / ranks for i, name in enumerate(names)}


def reduce_int(value, op='min', device=None):
    """Agree on an integer across ranks.

    Args:
        value (int): this rank's value
        op (str): ``'min'``, ``'max'`` or ``'sum'``
        device (torch.device): where the reduction runs

    Returns:
        int: the reduced value, identical on every rank

    .. warning:: A synchronization point: every rank must call it.
    """
    if world_size() == 1:
        return int(value)
    device = comm_device(torch.device('cpu')) if device is None else device
    ops = {'min': dist.ReduceOp.MIN, 'max': dist.ReduceOp.MAX, 'sum': dist.ReduceOp.SUM}
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=ops[op])
    return int(tensor.item())


def any_rank(flag, device=None):
    """True on every rank when ``flag`` is true on at least one.

    .. warning:: A synchronization point: every rank must call it.
    """
    return reduce_int(1 if flag else 0, 'max', device) == 1
