"""Bucketed gradient all-reduce: the engine behind :class:`~torchbearer_dist.AllReduceGradients`.

Parameters are packed into flat buckets of about ``bucket_cap_mb``, each closing after the tensor
that fills it, as DDP's do: in reverse registration order, then, with overlap, in the gradient-ready
order rank 0 measured in the first step. ``param.grad`` is a view of its bucket.

**The average is complete when backward returns.** As in DDP's reducer, a hook that fires during
backward queues an autograd end-of-backward callback; that callback (:meth:`GradientBuckets.reduce`,
the one place where buckets are reduced) sends what is left, waits for every bucket and averages,
before ``backward()`` returns. Every ``on_backward`` callback, wherever it sits in the Trial's list,
custom closures and ``Trial.with_closure`` included, then sees averaged gradients, and nothing can
touch a gradient while its all-reduce is in flight.

Backward passes are noticed by hooks, per parameter (overlapped) or on the model's output, that act
only while the buckets are *armed*, within a training step (:mod:`torchbearer_dist.sync._backward_hooks`).
Buckets start strictly in index order on every rank. Each bucket carries one presence flag per
parameter: a gradient that is None on this rank is zero-filled, and a parameter that no rank used
keeps ``grad = None``. The last bucket carries a stop flag, so a stop requested on any rank reaches
all of them without an extra collective. Sparse gradients travel densified and come back sparse;
complex parameters travel as real pairs.
"""
import math
import time

import torch
import torch.distributed as dist

from torchbearer_dist.sync._backward_hooks import BackwardHooks
from torchbearer_dist.sync.flat_buckets import (
    BUCKET_CAP_MB,
    FIRST_BUCKET_MB,
    check_options,
    check_supported,
    pack,
    ready_order,
)
from torchbearer_dist.sync.powersgd import PowerSGD

_COMPRESSION = {None: None, 'none': None, 'fp16': torch.float16, 'bf16': torch.bfloat16, 'powersgd': None}


class GradientBuckets(BackwardHooks):
    """Flat gradient buckets for a list of parameters, averaged over ranks before backward returns.

    Example:

        .. code-block:: python

            buckets = GradientBuckets(list(model.parameters()))
            buckets.attach(model)
            buckets.arm()        # a training step starts: its backward passes synchronize
            loss.backward()      # when it returns, every p.grad holds the average over ranks
            buckets.disarm()     # the step is over: backward passes stay local
            buckets.detach()

    Args:
        params (list of torch.nn.Parameter): the parameters to synchronize, in registration order
        bucket_cap_mb (float): capacity of a bucket in MiB
        first_bucket_mb (float): capacity of the first bucket to start (the last layers'
            gradients), small so that communication starts early, as in DDP
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in;
            they are averaged back in their own dtype; ``'powersgd'``: :class:`~torchbearer_dist.PowerSGD`
            averages every gradient instead of the buckets (options in ``powersgd``, a dict)
        overlap (bool or str): ``True`` starts each bucket from autograd hooks during backward,
            ``False`` fills and starts every bucket at the end of backward, ``'auto'`` overlaps only
            when the parameters span more than one bucket
        sync_every (int): synchronize only every k-th armed backward; the others stay local
        average (bool): ``True`` averages the gradients over ranks (a loss that is a mean over the
            batch); ``False`` sums them (a loss summed over the batch, ``reduction='sum'``): either
            way the result is the gradient of one process at N x B

    Raises:
        ValueError: a bad capacity, compression or overlap

    .. warning:: Every armed backward that synchronizes is a synchronization point.
    """

    def __init__(self, params, bucket_cap_mb=BUCKET_CAP_MB, first_bucket_mb=FIRST_BUCKET_MB, compression=None,
                 overlap='auto', sync_every=1, powersgd=None, average=True):
        check_options(bucket_cap_mb, compression, overlap)
        self.compression = _COMPRESSION[compression]
        self.world_size = dist.get_world_size()
        self.average = bool(average)
        self._divisor = self.world_size if self.average else 1
        self.params = list(params)
        check_supported(('#{}'.format(i), p) for i, p in enumerate(self.params))
        # PowerSGD replaces the buckets: it averages every .grad itself at the end of backward.
        self.powersgd = PowerSGD(self.params, **(powersgd or {})) if compression == 'powersgd' else None
        self._caps = (bucket_cap_mb, first_bucket_mb)
        self.buckets = [] if self.powersgd else pack(list(reversed(self.params)), bucket_cap_mb, first_bucket_mb)
        self.overlap = len(self.buckets) > 1 if overlap == 'auto' else bool(overlap and not self.powersgd)
        self._ready = [] if self.overlap else None  # first synchronized step: parameters in gradient-ready order
        self.sync_every = sync_every
        self._hooks, self._next, self._stop, self._repack = [], 0, 0.0, None
        self._armed = self._in_backward = self._syncing = self._unfinished = False
        self._pending_end = None
        self.backwards = self.began = 0  # armed backward passes (local ones included); noticed in this step
        self.synced = False  # a backward of the current step synchronized
        self.stop = False  # after a synchronizing backward: some rank asked to stop
        self.nonfinite = False  # after a synchronizing backward: the average held NaN or Inf (grads cleared)
        # What the communication cost, totals since construction (see traffic()); perf_counter around waits only.
        self.bytes_sent, self.wait_seconds, self.comm_seconds = 0, 0.0, 0.0
        self._sent_at = self._waited_at = None

    def same_params(self, params):
        """Whether ``params`` are exactly these parameters, compared by identity, in the same order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def arm(self):
        """A training step starts: its backward passes synchronize (every ``sync_every``-th of them)."""
        if self._repack is not None:  # buckets in the gradient-ready order measured in the first step
            for handle in self._hooks:
                handle.remove()
            self._hooks, self._next = [], 0
            self.buckets, self._repack = pack(self._repack, *self._caps), None
            self.attach()
        if self._unfinished:  # a backward that raised after sending some buckets
            for bucket in self.buckets:
                bucket.reset()
            self._next = 0
            self._unfinished = False
            self._sent_at = None
        self._armed = True
        self._in_backward = self.synced = self.stop = False
        self.began = 0

    def disarm(self):
        """The step is over: later backward passes stay local and start no collective."""
        self._armed = self._in_backward = False

    def request_stop(self):
        """Ask every rank to stop: :attr:`stop` is True on all of them after the next synchronization."""
        self._stop = 1.0

    def _start(self, bucket, missing=False):
        """Start one bucket's all-reduce; :meth:`_wait` ends it."""
        bucket.missing = missing
        if missing:
            bucket.flags.copy_(torch.tensor(bucket.present, dtype=bucket.flat.dtype))
        else:
            bucket.flags.fill_(1)
        if bucket.last:
            bucket.flat[-1] = self._stop
        if self.compression is None:
            bucket.wire = bucket.flat
        else:
            if self._divisor != 1:
                bucket.grads.div_(self._divisor)
            bucket.wire = bucket.flat.to(self.compression)
        bucket.sent = self._unfinished = True
        if self._sent_at is None:
            self._sent_at = time.perf_counter()
        bucket.work = dist.all_reduce(bucket.wire, async_op=True)
        self.bytes_sent += bucket.wire.numel() * bucket.wire.element_size()

    def _wait(self, bucket):
        """Wait for one bucket's all-reduce and leave the average in ``bucket.flat``."""
        begin = time.perf_counter()
        try:
            bucket.work.wait()
        except RuntimeError as error:  # gloo's plain RuntimeError: said to be a collective's by its type
            if isinstance(error, dist.DistError):
                raise
            raise dist.DistBackendError(str(error)) from error
        self._waited_at = time.perf_counter()
        self.wait_seconds += self._waited_at - begin
        if bucket.wire is not bucket.flat:
            bucket.flat.copy_(bucket.wire)
        elif self._divisor != 1:
            bucket.grads.div_(self._divisor)

    def reduce(self):
        """Send what backward left unsent, wait for every bucket and average: the one place buckets are reduced.

        Runs at the end of every synchronizing backward. Afterwards every ``p.grad`` holds the average
        (the sum with ``average=False``), :attr:`stop` says whether any rank asked to stop in this step,
        and :attr:`nonfinite` whether the average held NaN or Inf, in which case every gradient is set
        to None on every rank alike.

        .. warning:: A synchronization point: every rank must reduce once per synchronizing step.
        """
        stop = self.powersgd is not None and self.powersgd.reduce(stop=self._stop > 0)
        if self.powersgd is not None and not self.average:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.world_size)
        buckets = self.buckets
        for bucket in buckets[self._next:]:
            self._start(bucket, bucket.fill())
        for bucket in buckets:
            self._wait(bucket)
            bucket.unpack()
            if bucket.last:
                stop = bucket.flat[-1].item() > 0
            bucket.reset()
        if self._sent_at is not None:  # from the first bucket sent to the end of the last wait: the link in use
            self.comm_seconds += self._waited_at - self._sent_at
            self._sent_at = None
        self.stop = self.stop or stop
        self._next = 0
        self._stop = 0.0
        self._unfinished = False
        if self._ready is not None:  # from the next step on, pack in rank 0's gradient-ready order, as DDP does
            self._repack, self._ready = ready_order(self.params, self._ready, self.buckets), None
        nonfinite = not self.all_finite()
        self.nonfinite = self.nonfinite or nonfinite
        if nonfinite:
            for p in self.params:
                p.grad = None

    def traffic(self):
        """What communication cost so far: totals since construction, PowerSGD's included.

        Returns:
            tuple: ``(bytes_sent, wait_seconds, comm_seconds)``: the payload bytes this rank handed to
            all-reduce (gradients, presence flags and control slots, in the wire dtype; a ring all-reduce
            then moves ``2 (N - 1) / N`` times that over each rank's link, the payload itself for two
            ranks); the seconds the steps waited for all-reduces after backward had finished (the
            communication backward did not hide); and the seconds communication was in flight, from
            each step's first all-reduce to the end of its last wait
        """
        if self.powersgd is None:
            return self.bytes_sent, self.wait_seconds, self.comm_seconds
        sent, waited = self.powersgd.bytes_sent, self.powersgd.wait_seconds  # synchronous: in flight = waited
        return self.bytes_sent + sent, self.wait_seconds + waited, self.comm_seconds + waited

    def all_finite(self):
        """Whether every averaged gradient is finite; identical on all ranks after :meth:`reduce`.

        A sum is finite whenever every value is, unless it overflows: one fast sum per bucket, and
        the exact elementwise check (ten times slower) only for a bucket whose sum is not finite.
        """
        tensors = [b.grads for b in self.buckets] or [p.grad for p in self.params if p.grad is not None]
        for grads in tensors:
            if not math.isfinite(grads.sum().item()) and not bool(torch.isfinite(grads).all()):
                return False
        return True

