"""Pure torch.distributed operations: model checks, broadcast, metric and flag reductions.

Nothing here pickles: names, counts, metrics and flags all travel as fixed-shape tensors. The
bucketed gradient all-reduce lives in :mod:`torchbearer_dist.buckets`.
"""
import hashlib

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

_NAME_BYTES = 200


def world_size():
    """Number of processes in the default group, 1 outside one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank():
    """Rank of this process in the default group, 0 outside one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def module_device(module):
    """The device of the module's first parameter or buffer, the CPU for a module without any."""
    for tensor in module.state_dict().values():
        return tensor.device
    return torch.device('cpu')


def comm_device(device):
    """Where small control tensors live: the model's CUDA device under nccl, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == 'nccl':
        return device if device.type == 'cuda' else torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')


def _hash(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], 'big')


def _describe_entry(name, tensor):
    return "'{}' {} {}".format(name, tuple(tensor.shape), str(tensor.dtype).replace('torch.', ''))


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


def check_same_model(module, src=0):
    """Check that every rank holds the same parameter and buffer names, shapes and dtypes.

    Costs one all-reduce of four integers when the models agree. When they do not, every rank
    raises the same error, naming the first entry of the ``state_dict`` that differs, before any
    collective of mismatched size can abort gloo or corrupt the weights.

    Example: ::

        >>> import torch, torchbearer_dist.comm as comm
        >>> comm.check_same_model(torch.nn.Linear(2, 1))  # one process: nothing to compare

    Args:
        module (torch.nn.Module): the local replica
        src (int): the rank whose entry the message quotes as the reference

    Raises:
        RuntimeError: the models differ; the message, the same on every rank, names the first
            differing entry as ``src`` holds it and as the lowest rank that differs holds it

    .. warning:: A synchronization point: every rank must call it.
    """
    if world_size() == 1:
        return
    entries = list(module.state_dict().items())
    descriptions = [_describe_entry(name, tensor) for name, tensor in entries]
    device = comm_device(module_device(module))
    total = _hash('\n'.join(descriptions))
    (count_max, hash_max), (count_min, hash_min) = _max_and_min([len(entries), total], device)
    if count_max == count_min and hash_max == hash_min:
        return
    hashes = [_hash(d) + 1 for d in descriptions] + [0] * (count_max - len(entries))
    high, low = _max_and_min(hashes, device)
    first = next(i for i in range(count_max) if high[i] != low[i])
    mine = descriptions[first] if first < len(descriptions) else 'nothing (it has only {} entries)'.format(
        len(entries))
    theirs = _broadcast_text(mine, src, device)
    # Quote the lowest rank that differs from src, so that every rank, src included, raises the same message.
    differs = _wire_text(mine) != theirs
    other = _max_and_min([rank() if differs else world_size()], device)[1][0] % world_size()
    differing = _broadcast_text(mine, other, device)
    raise RuntimeError('the model differs across ranks at state_dict entry {}: rank {} has {}, rank {} has {}; '
                       'build the same model on every rank'.format(first, src, theirs, other, differing))


def _tensors(module):
    return [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]


def broadcast_state(module, src=0, method='broadcast'):
    """Copy ``src``'s parameters and buffers into every rank's ``module``, in place.

    Tensors are fused into one flat buffer per dtype and device, so a model of any size costs one
    message per dtype. Values are copied, never averaged.

    Example:

        .. code-block:: python

            from torchbearer_dist.comm import broadcast_state
            broadcast_state(model)                # collective broadcast
            broadcast_state(model, method='p2p')  # send from 0, recv elsewhere

    Args:
        module (torch.nn.Module): the local replica
        src (int): the rank whose values win
        method (str): ``'broadcast'`` (a collective) or ``'p2p'`` (``send`` from ``src`` to each rank
            and ``recv`` on the others, the form of the PyTorch tutorial)

    Raises:
        ValueError: ``method`` is neither ``'broadcast'`` nor ``'p2p'``

    .. warning:: A synchronization point: every rank must call it.
    """
    if method not in ('broadcast', 'p2p'):
        raise ValueError("method should be 'broadcast' or 'p2p', but given {!r}".format(method))
    _broadcast_tensors(_tensors(module), src, method)


def broadcast_buffers(module, src=0):
    """Copy ``src``'s buffers (BatchNorm running statistics, ...) into every rank's ``module``, in place.

    Each rank updates its buffers from its own batches; DistributedDataParallel copies rank 0's
    before every forward. One collective per buffer dtype.

    Args:
        module (torch.nn.Module): the local replica
        src (int): the rank whose buffers win

    .. warning:: A synchronization point: every rank must call it.
    """
    _broadcast_tensors(list(module.buffers()), src, 'broadcast')


def _broadcast_tensors(tensors, src, method):
    if world_size() == 1:
        return
    groups = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for key in sorted(groups, key=str):
            tensors = [t.detach() for t in groups[key]]
            flat = _flatten_dense_tensors(tensors)
            if dist.get_backend() == 'nccl' and flat.device.type != 'cuda':
                flat = flat.cuda()
            if method == 'broadcast':
                dist.broadcast(flat, src)
            elif rank() == src:
                for other in range(world_size()):
                    if other != src:
                        dist.send(flat, other)
            else:
                dist.recv(flat, src)
            if rank() != src:
                for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(value)


def weighted_means(values, weight, device=None):
    """Average scalar metrics over ranks, each rank weighted by ``weight`` (its sample count).

    Example:

        .. code-block:: python

            # rank 0 saw 100 samples at acc 0.9, rank 1 saw 50 at acc 0.6
            weighted_means({'acc': 0.9}, 100)  # {'acc': 0.8} on both ranks

    Args:
        values (dict): metric name to a number or 0-d tensor; every rank must pass the same names
        weight (float): this rank's weight, e.g. its number of samples; 0 leaves it out
        device (torch.device): where the reduction runs (CPU for gloo)

    Returns:
        dict: the same names mapped to floats, identical on every rank. A rank with weight 0
        contributes nothing; if every weight is 0, the plain mean is used.

    Raises:
        RuntimeError: the ranks hold different metric names

    .. warning:: A synchronization point: every rank must call it with the same names.
    """
    names = sorted(values)
    if world_size() == 1 or not names:
        return {name: float(values[name]) for name in names}
    device = comm_device(torch.device('cpu')) if device is None else device
    (count_max, hash_max), (count_min, hash_min) = _max_and_min([len(names), _hash('\n'.join(names))], device)
    if count_max != count_min or hash_max != hash_min:
        raise RuntimeError('ranks report different metrics ({} here: {}); give every rank the same metrics'.format(
            len(names), ', '.join(names)))
    numbers = [float(values[name]) for name in names]
    payload = torch.tensor([v * weight for v in numbers] + numbers + [float(weight), 1.0],
                           dtype=torch.float64, device=device)
    dist.all_reduce(payload)
    payload = payload.tolist()
    n = len(names)
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



def unwrap(model):
    """The module inside a DistributedDataParallel wrapper, or ``model`` itself.

    Args:
        model (torch.nn.Module): a model, wrapped or not

    Returns:
        torch.nn.Module: the model whose ``state_dict`` has no ``module.`` prefix
    """
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model
