"""Model-level collectives: the same architecture, the same values, and rank 0's weights everywhere."""
import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.fingerprint import _MODULUS, fingerprint  # noqa: F401 (fingerprint re-exported)


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
    check_same_tensors(list(module.state_dict().items()), src, collectives.comm_device(module_device(module)))


def check_same_tensors(entries, src=0, device=None):
    """:func:`check_same_model` for a list of ``(name, tensor)`` pairs, such as every model a Trial holds.

    Args:
        entries (list): ``(name, tensor)`` pairs in the same order on every rank
        src (int): the rank whose entry the message quotes as the reference
        device (torch.device): where the check travels; by default, chosen for the backend

    Raises:
        RuntimeError: the names, shapes or dtypes differ; the message names the first entry that differs

    .. warning:: A synchronization point: every rank must call it.
    """
    if collectives.world_size() == 1:
        return
    device = device or collectives.comm_device(entries[0][1].device if entries else torch.device('cpu'))
    descriptions = [_describe_entry(name, tensor) for name, tensor in entries]
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


def broadcast_tensors(tensors, src=0, method='broadcast', group=None):
    """Copy ``src``'s values of ``tensors`` (in the same order on every rank) into every rank's, in place.

    Args:
        tensors (list): the tensors, in the same order on every rank
        src (int): the rank whose values every rank takes (the default process group's)
        method (str): ``'broadcast'``, or ``'send_recv'`` (a send from ``src`` to each rank)
        group: a group object of :mod:`torchbearer_dist.sync.group` instead of the default process group: its
            first member's values, through its ``broadcast`` (``src`` and ``method`` are then not used)

    .. warning:: A synchronization point: every rank must call it.
    """
    _broadcast_tensors(list(tensors), src, method, group)


def _broadcast_tensors(tensors, src, method, group=None):
    if collectives.world_size() == 1 if group is None else group.alone():
        return
    groups = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for key in sorted(groups, key=str):
            tensors = [t.detach() for t in groups[key]]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if group is not None:
                flat = flat.to(group.device(flat))
                group.broadcast(flat).wait()
                took = group.rank() != 0
            else:
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
                took = collectives.rank() != src
            if took:
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


def differing_tensors(named_tensors, device=None):
    """The names of the tensors whose values differ across ranks, the same list on every rank.

    One all-reduce of eight integers when every rank agrees (the number and names of the tensors,
    and a combined fingerprint of their values); only on a difference a second one, of two integers
    per tensor, finds which differ. Cheap enough to run at every epoch end: see
    :class:`~torchbearer_dist.AllReduceGradients` (``check_divergence``).

    Example:

        .. code-block:: python

            from torchbearer_dist.sync.models import differing_tensors
            assert not differing_tensors(list(model.state_dict().items()))

    Args:
        named_tensors (list): ``(name, tensor)`` pairs, in the same order on every rank
        device (torch.device): where the fingerprints travel; by default, chosen for the backend

    Returns:
        list: names of the tensors that differ (empty when every rank holds the same values)

    Raises:
        RuntimeError: the ranks hold different numbers or names of tensors

    .. warning:: A synchronization point: every rank must call it.
    """
    if collectives.world_size() == 1:
        return []
    first = named_tensors[0][1].device if named_tensors else torch.device('cpu')
    device = device or collectives.comm_device(first)
    prints = torch.stack([fingerprint(t).to(device) for _, t in named_tensors]) if named_tensors else \
        torch.zeros((0, 2), dtype=torch.int64, device=device)
    odd = 2 * torch.arange(len(named_tensors), dtype=torch.int64, device=device) + 1  # odd: no bit is lost
    names = collectives._hash('\n'.join(name for name, _ in named_tensors))
    summary = torch.zeros(4, dtype=torch.int64, device=device)
    summary[0], summary[1] = len(named_tensors), names % _MODULUS
    summary[2:] = (prints * odd.unsqueeze(1)).sum(dim=0).remainder(_MODULUS)  # int64 wraps: exact, in any order
    both = torch.cat([summary, -summary])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[:4], -both[4:]
    if torch.equal(high, low):
        return []
    if high[0] != low[0] or high[1] != low[1]:
        raise RuntimeError('the ranks compare different sets of tensors ({} to {} tensors); every rank must hold the '
                           'same models and optimizers'.format(int(low[0]), int(high[0])))
    flat = prints.reshape(-1)
    both = torch.cat([flat, -flat])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    differs = (both[:flat.numel()] != -both[flat.numel():]).reshape(-1, 2).any(dim=1).tolist()
    return [name for (name, _), bad in zip(named_tensors, differs) if bad]


def broadcast_buffers_of(modules, src=0):
    """Copy ``src``'s buffers of every module in ``modules`` into every rank's, each buffer once.

    .. warning:: A synchronization point: every rank must call it.
    """
    seen, buffers = set(), []
    for module in modules:
        for buffer in module.buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                buffers.append(buffer)
    _broadcast_tensors(buffers, src, 'broadcast')
