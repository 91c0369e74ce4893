"""Small collectives on fixed-shape tensors: rank, world size, flags, counts and metric means.

Nothing here pickles: names, counts, metrics and flags all travel as fixed-shape tensors. The
bucketed gradient all-reduce lives in :mod:`torchbearer_dist.sync.buckets`.
"""
import hashlib

import torch
import torch.distributed as dist

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
