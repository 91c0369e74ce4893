"""Who takes part in a step, and how a tensor is reduced over them: the one object every averaging engine asks.

An engine (the gradient buckets, DiLoCo's meetings) is written once against this interface and handed the group of
its mode, as torchft's ``DistributedDataParallel`` is torch's DDP handed another process group:

- :class:`DistGroup`: a ``torch.distributed`` process group, the default one unless given one (the fail-fast mode).
  A collective that fails raises; gloo's plain ``RuntimeError`` becomes a ``DistBackendError``.
- :class:`QuorumGroup`: the live replicas of a torchft ``Manager``'s quorum (the fault-tolerant mode). Its size is
  the quorum's at each step; a collective never raises: the Manager records the error (``manager.errored()``), the
  result is then not to be trusted and ``should_commit()`` drops the step on every replica.

- :class:`HierarchicalGroup`: a replica group of several ranks (one machine's, started by ``torchrun``, ``launch()``
  or ``srun``) inside a torchft quorum of such groups: a tensor is summed within the group, each rank sends its
  share of it across the groups (to the ranks of the same index), and the shares are summed back within the group,
  so that the bytes between machines are split over the group's ranks.

All answer ``size()``, ``alone()``, ``rank()``, ``device(like)``, and start collectives in place that return a
work whose ``wait()`` returns True when the result holds every member's contribution (False: torchft failed it):
``all_reduce(tensor, op)`` with ``op`` :data:`SUM` or :data:`AVG` (the sum divided by ``size()``), and
``broadcast(tensor)`` (the group's first member's values on every member), and ``all_gather(output, tensor)``
(every member's ``tensor``, of one shape, stacked in ``output`` in rank order: ``output[i]`` is member ``i``'s).
Without a gather of their own, :class:`QuorumGroup` and :class:`HierarchicalGroup` gather by summing a table of
zeros that holds each member's values at its row (exact: ``x + 0 == x``; a ``-0.0`` arrives as ``0.0``).
"""
import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


#: The dtypes :meth:`~DistGroup.all_gather` takes; a bool travels as uint8, an int16 as int32 (gloo has none), a
#: complex as its real pairs, each back in its own dtype at the end, exactly.
GATHER_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _check_op(op):
    if op not in (SUM, AVG):
        raise ValueError('op should be ReduceOp.SUM or ReduceOp.AVG, but given {!r}'.format(op))


def _check_gather(output, tensor, size):
    """Raise a one-line ValueError unless ``output`` can hold ``size`` rows of ``tensor`` (before any collective)."""
    if tensor.dtype not in GATHER_DTYPES:
        raise ValueError('all_gather takes a tensor of a dtype among {}, but given {}; convert it first'.format(
            ', '.join(str(d).replace('torch.', '') for d in GATHER_DTYPES), tensor.dtype))
    shape = (size,) + tuple(tensor.shape)
    if tuple(output.shape) != shape or output.dtype != tensor.dtype or not output.is_contiguous():
        raise ValueError('all_gather needs a contiguous output of shape {} and dtype {} (size() rows of the tensor), '
                         'but given {} {}{}; allocate it as torch.empty(size(), *tensor.shape, '
                         'dtype=tensor.dtype)'.format(shape, tensor.dtype, tuple(output.shape), output.dtype,
                             '' if output.is_contiguous() else ' (not contiguous)'))


def _wire(tensor):
    """``tensor`` in a dtype every group sums and gathers exactly, and whether that is a copy (a view otherwise)."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8), False
    if tensor.is_complex():
        return torch.view_as_real(tensor), False
    if tensor.dtype == torch.int16:
        return tensor.to(torch.int32), True
    return tensor, False


class _Done:
    """A collective already complete: its wait returns whether the result holds every member's contribution."""

    def __init__(self, whole):
        self.whole = whole

    def wait(self):
        return self.whole


class _GatherWork:
    """A gather in flight into ``output`` through ``wire`` (its copy in a dtype the group carries, or None)."""

    def __init__(self, work, output, wire=None):
        self.work, self.output, self.wire = work, output, wire

    def wait(self):
        whole = self.work.wait()
        if self.wire is not None:
            self.output.copy_(self.wire)
        return whole


def _table(group, output, tensor):
    """Gather by a sum: ``output`` zeroed, this member's ``tensor`` at its row (none outside the count), summed in
    place over ``group``; returns the sum in flight (see :class:`_GatherWork`)."""
    output.zero_()
    rank = group.rank()
    if rank is not None:  # a replica outside the quorum sends nothing (torchft zeroes it too)
        output[rank].copy_(tensor)
    wire, copied = _wire(output)
    return _GatherWork(group.all_reduce(wire, SUM), output, wire if copied else None)


class _DistWork:
    """A ``torch.distributed`` collective in flight; its wait raises the collective's error as a ``DistError``."""

    def __init__(self, work, tensor=None, divisor=1):
        self.work, self.tensor, self.divisor = work, tensor, divisor

    def wait(self):
        try:
            self.work.wait()
        except RuntimeError as error:  # gloo's plain RuntimeError: said to be a collective's by its type
            if isinstance(error, dist.DistError):
                raise
            raise dist.DistBackendError(str(error)) from error
        if self.divisor != 1:
            self.tensor.div_(self.divisor)
        return True


class _QuorumWork:
    """A sum over the live replicas in flight (``work`` None: none started): its wait never raises, a failure is
    the Manager's to record (the step is then not committed), and it says whether the result is whole."""

    def __init__(self, manager, work, tensor=None, divisor=1):
        self.manager, self.work, self.tensor, self.divisor = manager, work, tensor, divisor

    def wait(self):
        if self.work is not None:
            try:
                self.work.wait()  # torchft's Manager.allreduce records its own failure; its process group's raises
            except Exception as error:  # a replica lost: torchft's rule, every replica drops the step
                self.manager.report_error(error)
        if self.divisor != 1:
            self.tensor.div_(self.divisor)
        return self.manager.errored() is None


def start_sum(process_group, manager, tensor, divisor=1):
    """Start the sum of ``tensor`` in place over every member of ``process_group``, a torchft process group that
    ``manager`` (its Manager) set up for the quorum, divided by ``divisor`` at the end. A failure, where it starts
    or while it runs, is recorded with the Manager (``report_error``), as torchft's own collectives do, so that
    ``should_commit()`` drops the step on every replica.

    Returns:
        the sum in flight: ``wait()`` never raises, and returns whether the result holds every member's part
    """
    options = AllreduceOptions()
    options.reduceOp = SUM
    try:
        work = process_group.allreduce([tensor], options)
    except Exception as error:  # its quorum's group could not be set up: the step fails on every replica
        manager.report_error(error)
        work = None
    return _QuorumWork(manager, work, tensor, divisor)


class DistGroup:
    """The ranks of a ``torch.distributed`` process group: the fail-fast mode's group.

    Example:

        .. code-block:: python

            group = DistGroup()              # the default process group, read when used
            group.all_reduce(grads, AVG).wait()

    Args:
        process_group (torch.distributed.ProcessGroup): the group; None: the default one (``WORLD``), read at
            each call, so one object serves before and after ``init_process_group``

    .. warning:: Every collective is a synchronization point of the group's ranks.
    """

    def __init__(self, process_group=None):
        self.process_group = process_group

    def size(self):
        """The number of ranks, 1 outside a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def alone(self):
        """Whether no other process takes part (then nothing needs to travel)."""
        return self.size() == 1

    def rank(self):
        """This process's rank in the group, 0 outside a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.process_group)

    def device(self, like=None):
        """Where small control tensors of the group live: ``like``'s CUDA device (or the current one) under nccl,
        the CPU otherwise."""
        if dist.is_initialized() and dist.get_backend(self.process_group) == 'nccl':
            if like is not None and like.type == 'cuda':
                return like
            return torch.device('cuda', torch.cuda.current_device())
        return torch.device('cpu')

    def all_reduce(self, tensor, op=SUM):
        """Reduce ``tensor`` in place over the ranks; ``AVG`` divides the sum by :meth:`size` (gloo has no AVG).

        Returns:
            the collective in flight: ``wait()`` leaves the result in ``tensor`` and returns True

        .. warning:: A synchronization point: every rank must issue the same collectives in the same order.
        """
        _check_op(op)
        work = dist.all_reduce(tensor, op=SUM, group=self.process_group, async_op=True)
        return _DistWork(work, tensor, self.size() if op == AVG else 1)

    def broadcast(self, tensor):
        """The group's first rank's ``tensor``, in place on every rank; returns the collective in flight.

        .. warning:: A synchronization point: every rank must call it.
        """
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        return _DistWork(dist.broadcast(tensor, src, group=self.process_group, async_op=True))

    def all_gather(self, output, tensor):
        """Every rank's ``tensor`` (one shape on every rank), stacked in ``output`` in rank order.

        Example:

            .. code-block:: python

                output = torch.empty(group.size(), *mine.shape, dtype=mine.dtype)
                group.all_gather(output, mine).wait()   # output[i] is rank i's

        Args:
            output (torch.Tensor): contiguous, ``[size(), *tensor.shape]``, of ``tensor``'s dtype (one of
                :data:`GATHER_DTYPES`)
            tensor (torch.Tensor): this rank's values

        Returns:
            the collective in flight: ``wait()`` leaves the result in ``output`` and returns True

        Raises:
            ValueError: ``output`` or the dtype do not fit (before the collective)

        .. warning:: A synchronization point: every rank must issue the same collectives in the same order.
        """
        _check_gather(output, tensor, self.size())
        if self.alone():
            output[0].copy_(tensor)
            return _Done(True)
        wire, copied = _wire(output)
        parts = list(wire.unbind(0))
        work = dist.all_gather(parts, _wire(tensor)[0].contiguous(), group=self.process_group, async_op=True)
        return _GatherWork(_DistWork(work), output, wire if copied else None)


#: The fail-fast mode's group: the default process group.
WORLD = DistGroup()


def _nothing():
    pass


class QuorumGroup:
    """The live replicas of a torchft ``Manager``'s quorum: the fault-tolerant mode's group.

    Its members are the replicas of the quorum the Manager holds when a collective starts (``start_quorum()``
    at every step): :meth:`size` is the live count, and ``AVG`` is torchft's own, the sum divided by the
    replicas live at that step. With ``trained`` given (DiLoCo's meetings), one all-reduce at construction
    tells every replica which of them trained since the last meeting: a replica that did not (it just healed,
    holding the anchor) takes part in every collective with zeros and counts for nothing, :meth:`size` is the
    replicas that trained, and :meth:`broadcast` sends the first of them's values.

    Example:

        .. code-block:: python

            group = QuorumGroup(manager)     # after manager.start_quorum()
            ok = group.all_reduce(grads, AVG).wait()   # False: torchft failed it, should_commit() drops the step

    Args:
        manager (torchft.Manager): the replica's Manager
        trained (bool): None: every live replica contributes; else whether this one trained since the last
            meeting (a collective at construction, after ``start_quorum()``)
        ready (callable): called before each use of the group, to take a quorum still in flight (see
            :class:`~torchbearer_dist.ft.FaultTolerantAllReduce`)
        process_group (torchft.ProcessGroup): the process group the Manager was built with (its ``pg``): each sum
            is started on it directly, under the rules of ``Manager.allreduce`` (nothing after a failure of the
            step, zeros from a replica that heals in it, a failure recorded with ``report_error``), without the
            chain of futures and the timer that ``Manager.allreduce`` wraps around each collective (the process
            group's own timeout bounds it); None: through ``Manager.allreduce``

    .. warning:: Every collective is a synchronization point of the live replicas.
    """

    def __init__(self, manager, trained=None, ready=None, process_group=None):
        self.manager, self.trained, self._ready = manager, trained, ready or _nothing
        self.process_group = process_group
        self._trainers = self._head = None
        if trained is not None:
            flags = torch.zeros(manager.num_participants(), dtype=torch.float64)
            flags[manager.participating_rank()] = 1.0 if trained else 0.0
            self._sum(flags).wait()  # a failure leaves this replica's own
            self._trainers = int(flags.sum().item())
            self._head = int(flags.argmax().item()) == manager.participating_rank() and trained

    def size(self):
        """The replicas that count: the live ones at this step (with ``trained``: those that trained)."""
        self._ready()
        return self.manager.num_participants() if self._trainers is None else self._trainers

    def alone(self):
        """Whether no other replica is live (then nothing needs to travel)."""
        self._ready()
        return self.manager.num_participants() == 1

    def rank(self):
        """This replica's rank in the quorum (None: not in it)."""
        self._ready()
        return self.manager.participating_rank()

    def device(self, like=None):
        """Where tensors the Manager reduces live: the CPU (torchft's gloo group)."""
        return torch.device('cpu')

    def all_reduce(self, tensor, op=SUM):
        """Reduce ``tensor`` in place over the live replicas; returns the collective in flight (see the module).

        .. warning:: A synchronization point of the live replicas.
        """
        self._ready()
        _check_op(op)
        if self._trainers is None:  # AVG divides by the replicas live at this step, as torchft's own
            return self._sum(tensor, op)
        if not self.trained:
            tensor.zero_()
        return self._sum(tensor, divisor=self._trainers if op == AVG and self._trainers else 1)

    def broadcast(self, tensor):
        """The first counting replica's ``tensor``, in place on every replica; returns the collective in flight.

        .. warning:: A synchronization point of the live replicas.
        """
        self._ready()
        head = self.manager.participating_rank() == 0 if self._head is None else self._head
        if not head:
            tensor.zero_()
        return self._sum(tensor)

    def _sum(self, tensor, op=SUM, divisor=1):
        """Start the sum of ``tensor`` in place over the live replicas (``AVG``: divided by their count, as torchft
        does), divided by ``divisor`` at the end; a replica that heals in this quorum sends zeros (torchft: it does
        not participate)."""
        manager = self.manager
        if self.process_group is None:
            return _QuorumWork(manager, manager.allreduce(tensor, reduce_op=op), tensor, divisor)
        if manager.errored() is not None:  # torchft's rule: after a failure, the step's collectives do nothing
            return _QuorumWork(manager, None, tensor, divisor)
        manager.wait_quorum()
        if not manager.is_participating():
            tensor.zero_()
        return start_sum(self.process_group, manager, tensor, manager.num_participants() if op == AVG else divisor)

    def all_gather(self, output, tensor):
        """Every live replica's ``tensor``, stacked in ``output`` by rank in the quorum (see
        :meth:`DistGroup.all_gather`); a replica outside the quorum (:meth:`rank` None) receives the others' and
        sends none. ``wait()`` returns False where torchft failed the sum: ``output`` is then not to be trusted.

        Raises:
            ValueError: ``output`` or the dtype do not fit, or this group counts only the replicas that trained
                (``trained`` given: a gather has a row for every live replica; gather over ``QuorumGroup(manager)``)

        .. warning:: A synchronization point of the live replicas.
        """
        self._ready()
        if self._trainers is not None:
            raise ValueError('all_gather gathers every live replica, but this QuorumGroup counts only those that '
                             'trained (trained={!r}); gather over QuorumGroup(manager)'.format(self.trained))
        _check_gather(output, tensor, self.size())
        return _table(self, output, tensor)


class _HierarchicalWork:
    """A hierarchical all-reduce in flight: the sum within the replica group started; :meth:`wait` does the rest."""

    def __init__(self, group, tensor, op, local_work):
        self.group, self.tensor, self.op, self.local_work = group, tensor, op, local_work

    def wait(self):
        group, tensor = self.group, self.tensor
        self.local_work.wait()  # within the group: a lost rank raises (the fail-fast mode's rules)
        flat = tensor.view(-1)
        begin, end = group.share(flat.numel())
        whole = True
        if end > begin:  # the same bounds at this rank's index in every group: all skip an empty share alike
            whole = group.quorum.all_reduce(flat[begin:end], SUM).wait()
        flat[:begin].zero_()
        flat[end:].zero_()
        group.local.all_reduce(tensor, SUM).wait()  # every rank's share, summed over every group: the whole sum
        if self.op == AVG:
            tensor.div_(group.size())
        return whole


class HierarchicalGroup:
    """A replica group of several ranks (its ``torch.distributed`` group) inside a torchft quorum of such groups.

    Every group has the same number of ranks; rank ``i`` of a group runs a Manager whose quorum holds rank ``i``
    of every live group (torchft's replica groups). :meth:`all_reduce` sums within the group, sends this rank's
    ``1/k`` of the sum to the same rank of the other groups, and sums the shares back within the group (a
    hierarchical all-reduce: each machine sends the single-rank groups' bytes, split over its ``k`` ranks). A
    failure within the group raises, as in the fail-fast mode (the group is lost as a unit); one across groups is
    torchft's (``wait()`` returns False and ``should_commit()``, which the group's Manager decides for all its
    ranks, drops the step).

    Example:

        .. code-block:: python

            group = HierarchicalGroup(DistGroup(), QuorumGroup(manager))   # under torchrun, after start_quorum()
            ok = group.all_reduce(grads, AVG).wait()   # the average over every rank of every live group

    Args:
        local (DistGroup): this replica group's ranks
        quorum (QuorumGroup): this rank's Manager's quorum: the same rank of every live group

    .. warning:: Every collective is a synchronization point of the group's ranks and of the live groups.
    """

    def __init__(self, local, quorum):
        self.local, self.quorum = local, quorum

    def size(self):
        """The ranks that count: the group's ranks times the live groups at this step."""
        return self.local.size() * self.quorum.size()

    def alone(self):
        """Whether no other rank takes part."""
        return self.local.alone() and self.quorum.alone()

    def rank(self):
        """This rank's place among every rank of the live groups (None: its group is in no quorum)."""
        index = self.quorum.rank()
        return None if index is None else index * self.local.size() + self.local.rank()

    def device(self, like=None):
        """Where small control tensors live: the group's device (the quorum's wire is the CPU's)."""
        return self.local.device(like)

    def share(self, numel):
        """``(begin, end)``: the slice of a flat tensor of ``numel`` values this rank sends across the groups."""
        k, i = self.local.size(), self.local.rank()
        return numel * i // k, numel * (i + 1) // k

    def all_reduce(self, tensor, op=SUM):
        """Reduce ``tensor`` (contiguous) in place over every rank of the live groups; returns the collective in
        flight, whose ``wait()`` raises where the group lost a rank and returns False where torchft failed it.

        .. warning:: A synchronization point of the group's ranks and of the live groups.
        """
        _check_op(op)
        return _HierarchicalWork(self, tensor, op, self.local.all_reduce(tensor, SUM))

    def broadcast(self, tensor):
        """The first rank of the quorum's first group's ``tensor``, in place on every rank; returns the collective
        done.

        .. warning:: A synchronization point of the group's ranks and of the live groups.
        """
        self.local.broadcast(tensor).wait()
        return _Done(self.quorum.broadcast(tensor).wait())

    def all_gather(self, output, tensor):
        """Every rank's ``tensor`` over the live groups, stacked in ``output`` by :meth:`rank` (see
        :meth:`DistGroup.all_gather`); returns the collective done. ``wait()`` returns the same on every rank of
        the group (one more sum within it): False where torchft failed the part across the groups on any of its
        ranks, ``output`` then not to be trusted; a loss within the group raises.

        Raises:
            ValueError: ``output`` or the dtype do not fit (before any collective)

        .. warning:: A synchronization point of the group's ranks and of the live groups.
        """
        _check_gather(output, tensor, self.size())
        whole = _table(self, output, tensor).wait()
        failed = torch.tensor([0.0 if whole else 1.0], dtype=torch.float64, device=self.device(output.device))
        self.local.all_reduce(failed, SUM).wait()  # every rank of the group takes the same path on
        return _Done(failed.item() == 0.0)
