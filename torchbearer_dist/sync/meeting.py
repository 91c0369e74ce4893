"""A DiLoCo meeting in flight: its collectives posted with ``async_op=True`` while the ranks train on.

Every collective is posted from the training thread, in the same order on every rank, so the ranks'
collectives match without a second process group or thread of our own; gloo's threads carry them.
They go through a *group* (:mod:`torchbearer_dist.sync.group`): :data:`~torchbearer_dist.sync.group.WORLD` (the
default process group), or the fault-tolerant mode's group of the replicas that trained since the last meeting
(:func:`meet`, handed it and torchft's commit: no torchft here).
"""
import torch

from torchbearer_dist.sync import wire
from torchbearer_dist.sync.group import SUM, WORLD


class _Done:
    """A mean that is already there (a world of one), with the interface of a collective in flight."""

    def __init__(self, values):
        self.values, self.bytes = values, 0

    def advance(self):
        pass

    def wait(self):
        return self.values


def meet(engine, group, commit):
    """A blocking DiLoCo meeting over ``group``, the outer step taken only if ``commit()`` says so.

    The fault-tolerant mode's meetings (:meth:`FaultTolerantAllReduce.meet
    <torchbearer_dist.FaultTolerantAllReduce.meet>`): ``group`` is the live replicas that trained since the last
    meeting (a :class:`~torchbearer_dist.sync.group.QuorumGroup`, or a
    :class:`~torchbearer_dist.sync.group.HierarchicalGroup` of replica groups of several ranks), ``commit``
    torchft's decision. The pseudo-gradients are averaged in fp32 (the parameters' dtype) over the group; then,
    committed, the anchor steps and every parameter becomes it; not (a replica lost during the meeting), the
    meeting is dropped: the anchor stays and every parameter goes back to it, the round's local progress lost on
    every survivor, like a dropped step.

    Example:

        .. code-block:: python

            manager.start_quorum()
            committed = meet(engine, QuorumGroup(manager, trained=True), manager.should_commit)

    Args:
        engine (OuterStep): with ``compression=None``, no meeting in flight
        group: who meets (the group's interface, :mod:`torchbearer_dist.sync.group`); of size 0 where nobody
            trained since the last meeting (the meeting then only commits)
        commit (callable): called once the average arrived, on every member: True where every member may step

    Returns:
        bool: whether the meeting was committed

    .. warning:: A synchronization point with the group's members.
    """
    engine.group = group
    try:
        if group.size() > 0:
            engine.begin()
            engine.meeting.wait()
        committed = commit()
        if committed and engine.meeting is not None:
            engine.finish(carry=False)
        elif not committed:
            engine.restart(mid_round=True)
    finally:
        engine.group = WORLD
    return committed


class _Summed:
    """An fp32 (or the parameters' dtype) all-reduce in flight of values already divided by the world size."""

    def __init__(self, values, group):
        self.values = values
        self.work = group.all_reduce(values, SUM)
        self.bytes = values.numel() * values.element_size()

    def advance(self):
        pass

    def wait(self):
        self.work.wait()
        return self.values


class Meeting:
    """One meeting's collectives, in flight: pseudo-gradients by dtype, floating buffers, rank 0's integer buffers.

    Posted at construction with ``async_op=True`` (:meth:`OuterStep.begin
    <torchbearer_dist.sync.diloco.OuterStep.begin>`); keeps this rank's own pseudo-gradients and
    buffers as they were then, for :meth:`OuterStep.finish
    <torchbearer_dist.sync.diloco.OuterStep.finish>` to carry the local progress made since. A
    checkpoint holds :meth:`shared` (the same on every rank, once arrived) and each rank's
    :meth:`local`; ``Meeting(engine, restore=(shared, local))`` rebuilds it, arrived.

    Args:
        engine (OuterStep): whose anchor, parameters, buffers and wire are used
        stop (bool): this rank's stop request, which travels with the buffers
        restore (tuple): ``(shared, local)`` of a saved meeting: nothing is posted
    """

    def __init__(self, engine, stop=False, restore=None):
        world, alone = engine.group.size(), engine.group.alone()
        shared, saved = restore if restore is not None else (None, None)
        saved = iter(saved or ())
        self.stop, self._results = stop, None
        by_dtype = {}
        for i, p in enumerate(engine.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        self.groups, self.means, self._own = [], [], {}
        for k, dtype in enumerate(sorted(by_dtype, key=str)):  # the same order on every rank
            indices = by_dtype[dtype]
            local = next(saved) if restore else torch.cat([(engine.anchor[i] - engine.params[i]).reshape(-1)
                                                          for i in indices])
            self.groups.append((dtype, indices, local))
            if restore or alone:
                self.means.append(_Done(shared['means'][k] if restore else local))
            elif engine.compression is None:
                self.means.append(_Summed(local / world, engine.group))
            else:
                self.means.append(wire.PendingMean(local.to(torch.float32), engine.compression))
            offset = 0
            for i in indices:
                self._own[i] = local[offset:offset + engine.anchor[i].numel()].view(engine.anchor[i].shape)
                offset += engine.anchor[i].numel()
        self.buffers = self.buffer_sum = None
        self.ranks_zero = []
        if not alone:
            floating = [b for b in engine.buffers if b.is_floating_point()]
            device = floating[0].device if floating else (engine.params[0].device if engine.params
                                                          else torch.device('cpu'))
            self.buffers = next(saved) if restore else torch.cat(
                [b.reshape(-1).to(torch.float64) for b in floating] +
                [torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device=device)])
            self.buffer_sum = _Done(shared['buffer_sum']) if restore else _Summed(self.buffers.clone(), engine.group)
            others = [b for b in engine.buffers if not b.is_floating_point()]
            for k, b in enumerate(others):
                if restore:
                    self.ranks_zero.append((next(saved), shared['zeros'][k], None))
                else:
                    zero = b.detach().clone()
                    self.ranks_zero.append((b.detach().clone(), zero, engine.group.broadcast(zero)))
        if not restore:
            engine.bytes_sent += sum(m.bytes for m in self.means) + sum(
                z.numel() * z.element_size() for _, z, _ in self.ranks_zero) + (
                self.buffer_sum.bytes if self.buffer_sum is not None else 0)

    def own(self, i):
        """This rank's own pseudo-gradient of parameter ``i``, as it was when the meeting began."""
        return self._own[i]

    def advance(self):
        """Move a compressed mean on to its second collective (at the same step on every rank)."""
        for mean in self.means:
            mean.advance()

    def wait(self):
        """``(means by dtype group, buffer sum (or None), [(own, rank 0's) integer buffers])``, once all arrived."""
        if self._results is None:
            means = [mean.wait().to(dtype) for mean, (dtype, _, _) in zip(self.means, self.groups)]
            buffer_sum = self.buffer_sum.wait() if self.buffer_sum is not None else None
            for _, _, work in self.ranks_zero:
                if work is not None:
                    work.wait()
            self._results = means, buffer_sum, [(own, zero) for own, zero, _ in self.ranks_zero]
        return self._results

    def shared(self):
        """What every rank received, the same on every rank (waits for it): for a checkpoint."""
        means, buffer_sum, ranks_zero = self.wait()
        return {'means': means, 'buffer_sum': buffer_sum, 'zeros': [zero for _, zero in ranks_zero]}

    def local(self):
        """This rank's own tensors of the meeting (pseudo-gradients, buffers as they were): for a checkpoint."""
        return [local for _, _, local in self.groups] + ([self.buffers] if self.buffers is not None else []) + \
            [own for own, _, _ in self.ranks_zero]
