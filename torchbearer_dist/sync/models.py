"""Model-level collectives: the same architecture, the same values, and rank 0's weights everywhere."""
import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives


def module_device(module):
    """The device of the module's first parameter or buffer, the CPU for a module without any."""
    for tensor in module.state_dict().values():
        return tensor.device
    return torch.device('cpu')


def _describe_entry(name, tensor):
    return "'{}' {} {}".format(name, tuple(tensor.shape), str(tensor.dtype).replace('torch.', ''))


def check_same_model(module, src=0):
    """Check that every rank holds the same parameter and buffer names, shapes and dtypes.

    Costs one all-reduce of four integers when the models agree. When they do not, every rank
    raises the same error, naming the first entry of the ``state_dict`` that differs, before any
    collective of mismatched size can abort gloo or corrupt the weights.

    Example: ::

        >>> import torch
        >>> from torchbearer_dist.sync.models import check_same_model
        >>> check_same_model(torch.nn.Linear(2, 1))  # one process: nothing to compare

    Args:
        module (torch.nn.Module): the local replica
        src (int): the rank whose entry the message quotes as the reference

    Raises:
        RuntimeError: the models differ; the message, the same on every rank, names the first
            differing entry as ``src`` holds it and as the lowest rank that differs holds it

    .. warning:: A synchronization point: every rank must call it.
    """
    if collectives.world_size() == 1:
        return
    entries = list(module.state_dict().items())
    descriptions = [_describe_entry(name, tensor) for name, tensor in entries]
    device = collectives.comm_device(module_device(module))
    total = collectives._hash('\n'.join(descriptions))
    (count_max, hash_max), (count_min, hash_min) = collectives._max_and_min([len(entries), total], device)
    if count_max == count_min and hash_max == hash_min:
        return
    hashes = [collectives._hash(d) + 1 for d in descriptions] + [0] * (count_max - len(entries))
    high, low = collectives._max_and_min(hashes, device)
    first = next(i for i in range(count_max) if high[i] != low[i])
    mine = descriptions[first] if first < len(descriptions) else 'nothing (it has only {} entries)'.format(
        len(entries))
    theirs = collectives._broadcast_text(mine, src, device)
    # Quote the lowest rank that differs from src, so that every rank, src included, raises the same message.
    differs = collectives._wire_text(mine) != theirs
    size = collectives.world_size()
    other = collectives._max_and_min([collectives.rank() if differs else size], device)[1][0] % size
    differing = collectives._broadcast_text(mine, other, device)
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

            from torchbearer_dist.sync.models import broadcast_state
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
    if collectives.world_size() == 1:
        return
    groups = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for key in sorted(groups, key=str):
            tensors = [t.detach() for t in groups[key]]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if dist.get_backend() == 'nccl' and flat.device.type != 'cuda':
                flat = flat.cuda()
            if method == 'broadcast':
                dist.broadcast(flat, src)
            elif collectives.rank() == src:
                for other in range(collectives.world_size()):
                    if other != src:
                        dist.send(flat, other)
            else:
                dist.recv(flat, src)
            if collectives.rank() != src:
                for tensor, value in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                    tensor.copy_(value.view_as(tensor))


def unwrap(model):
    """The module inside a DistributedDataParallel wrapper, or ``model`` itself.

    Args:
        model (torch.nn.Module): a model, wrapped or not

    Returns:
        torch.nn.Module: the model whose ``state_dict`` has no ``module.`` prefix
    """
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def check_replicas(module, buffers=True):
    """Check that parameters (and buffers) hold the same values on every rank.

    Each tensor is summarised by two float64 checksums (its sum and a position-weighted sum);
    one MAX all-reduce of them and their negatives compares every rank at once.

    Args:
        module (torch.nn.Module): the local replica
        buffers (bool): also compare buffers (BatchNorm statistics drift apart within a training
            pass by design, until :class:`~torchbearer_dist.AllReduceGradients` re-broadcasts them)

    Raises:
        RuntimeError: naming the first tensor whose values differ across ranks

    .. warning:: A synchronization point: every rank must call it.
    """
    if collectives.world_size() == 1:
        return
    entries = list(module.state_dict().items()) if buffers else list(module.named_parameters())
    sums = []
    with torch.no_grad():
        for _, tensor in entries:
            values = tensor.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
            sums.append(torch.stack([values.sum(), (values * weights).sum()]))
    device = collectives.comm_device(module_device(module))
    local = torch.stack(sums).reshape(-1).to(device) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = local.numel()
    differs = (both[:n] != -both[n:]).reshape(-1, 2).any(dim=1).tolist()
    if any(differs):
        first = differs.index(True)
        raise RuntimeError("replicas diverged: '{}' differs across ranks (first of {} differing tensors); "
                           "something updated the model on one rank only".format(entries[first][0], sum(differs)))
