"""Every rank's local DiLoCo state on rank 0, for a step checkpoint written between two meetings.

Between meetings each rank's weights, buffers and inner optimizer state are its own; a checkpoint that
resumes bit-identical needs all of them. :func:`gather_local` sends them to rank 0 in one fixed-shape
``gather`` per dtype, no pickling.
"""
import copy
import time
import warnings
import zlib

import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.meeting import Meeting


def _tensor_leaves(optimizer_state):
    """The tensors of an optimizer's ``state_dict()['state']``, in a fixed order (parameter index, then name)."""
    leaves = []
    for index in sorted(optimizer_state['state']):
        entry = optimizer_state['state'][index]
        leaves.extend(entry[name] for name in sorted(entry) if isinstance(entry[name], torch.Tensor))
    return leaves


def _with_leaves(optimizer_state, tensors):
    """A copy of ``optimizer_state`` whose tensors, in :func:`_tensor_leaves`' order, are ``tensors``."""
    tensors = iter(tensors)
    state = {index: {name: next(tensors) if isinstance(value, torch.Tensor) else value
                     for name, value in sorted(entry.items())}
             for index, entry in sorted(optimizer_state['state'].items())}
    return {'state': state, 'param_groups': copy.deepcopy(optimizer_state['param_groups'])}


def gather_local(engine, optimizer, extra=()):
    """Every rank's local weights, buffers and inner optimizer state, on rank 0, each tensor in its own dtype.

    One fixed-shape ``gather`` per dtype (no pickling), after one all-reduce that checks every rank
    holds the same shapes and dtypes; the bytes and seconds count in ``engine.traffic()``.

    Args:
        engine (OuterStep): its ``params`` and ``buffers`` are gathered
        optimizer (torch.optim.Optimizer): the inner optimizer, whose ``state_dict()`` is gathered
        extra (list): more tensors of each rank's own (a meeting in flight's), the same shapes on every rank

    Returns:
        list: on rank 0, per rank ``{'params', 'buffers', 'optimizer', 'extra'}``; None on the other ranks

    Raises:
        RuntimeError: the inner optimizer holds state of different shapes on different ranks

    .. warning:: A synchronization point: every rank must call it at the same step.
    """
    began = time.perf_counter()
    state = copy.deepcopy(optimizer.state_dict())
    extra = list(extra)
    leaves = [t.detach() for t in list(engine.params) + list(engine.buffers) + extra + _tensor_leaves(state)]
    device = collectives.comm_device(leaves[0].device if leaves else torch.device('cpu'))  # gloo: CPU only
    signature = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t in leaves]).encode())
    seen = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen[0] != -seen[1]:
        raise RuntimeError('the inner optimizer holds state of different shapes on different ranks, so a step '
                           'checkpoint cannot hold it; give every parameter a gradient on every rank')
    world, mine = collectives.world_size(), collectives.rank() == 0
    values = [[None] * len(leaves) for _ in range(world)]
    by_dtype = {}
    for i, t in enumerate(leaves):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        indices = by_dtype[dtype]
        flat = torch.cat([leaves[i].reshape(-1).to(device) for i in indices])
        everyone = [torch.empty_like(flat) for _ in range(world)] if mine else None
        dist.gather(flat, everyone, dst=0)
        engine.bytes_sent += flat.numel() * flat.element_size()
        for rank, gathered in enumerate(everyone or ()):
            offset = 0
            for i in indices:
                n = leaves[i].numel()
                values[rank][i] = gathered[offset:offset + n].to(leaves[i].device).view_as(leaves[i]).clone()
                offset += n
    engine.comm_seconds += time.perf_counter() - began
    if not mine:
        return None
    n, m, e = len(engine.params), len(engine.buffers), len(extra)
    return [{'params': tensors[:n], 'buffers': tensors[n:n + m], 'extra': tensors[n + m:n + m + e],
             'optimizer': _with_leaves(state, tensors[n + m + e:])} for tensors in values]


@torch.no_grad()
def restore_local(engine, saved, optimizer):
    """Put this rank's local state of a DiLoCo checkpoint back: weights, buffers, inner optimizer, a meeting in flight.

    At the world size that wrote it, every rank takes its own entry and the run goes on bit-identical;
    at another, or from a checkpoint without every rank's entry (another checkpointer's), every rank
    starts again from the anchor and the buffers as of the last meeting (a warning on rank 0 says so; a
    meeting in flight then is dropped).

    Args:
        engine (OuterStep): the engine, its anchor and outer state already loaded
        saved (dict): the callback's state: ``inner_steps``, ``local`` (per rank, or None), ``meeting``
        optimizer (torch.optim.Optimizer): the inner optimizer

    Returns:
        tuple: ``(inner_steps, steps until the meeting in flight lands)``
    """
    local, meeting = saved.get('local'), saved.get('meeting')
    if (saved['inner_steps'] or meeting) and local is not None and len(local) == collectives.world_size():
        mine = local[collectives.rank()]
        if meeting is not None:  # in flight when the checkpoint was written: it lands at the same step
            engine.meeting = Meeting(engine, restore=(meeting['shared'], mine['extra']))
        for p, value in zip(engine.params, mine['params']):
            p.copy_(value)
        for b, value in zip(engine.buffers, mine['buffers']):
            b.copy_(value)
        optimizer.load_state_dict(mine['optimizer'])
        return saved['inner_steps'], meeting['due'] if meeting is not None else 0
    if (saved['inner_steps'] or meeting) and collectives.rank() == 0:
        where = ("holds no rank's own weights (its checkpointer saved one process's state; "
                 "torchbearer_dist.Checkpoint gathers every rank's)" if local is None else
                 'was written at world size {}; at world size {}'.format(len(local), collectives.world_size()))
        warnings.warn('the checkpoint was written {} local steps after an outer step and {}: every rank starts again '
                      'from the anchor'.format(saved['inner_steps'], where), stacklevel=3)
    engine.to_anchor()  # the parameters and the buffers, every rank's the same
    return 0, 0
