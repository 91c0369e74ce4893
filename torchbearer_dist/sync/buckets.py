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

Backward passes are noticed in one of two ways:

- *Overlapped*: a post-accumulate-grad hook on each parameter copies its gradient in; once every
  gradient of a bucket is in, the bucket's all-reduce starts while backward computes the rest.
- *After backward*: one tensor hook on the model's output (the place of DDP's ``_DDPSink``) queues
  the end-of-backward callback, which copies every gradient into its bucket (one ``copy_`` per
  parameter, no hook per parameter). Parameters outside the model (learnable loss terms) get a post-accumulate hook.
  ``overlap='auto'`` (the default) overlaps only when the parameters span more than one bucket.

The hooks act only while the buckets are *armed*, within a training step, so a backward outside a Trial's
training step never starts a collective. The first hook of a pass decides whether it synchronizes (every
``sync_every``-th armed pass) and queues its end, which reduces the buckets.
Buckets start strictly in index order on every rank. Each bucket carries one presence flag per
parameter: a gradient that is None on this rank is zero-filled, and a parameter that no rank used
keeps ``grad = None``. The last bucket carries a stop flag, so a stop requested on any rank reaches
all of them without an extra collective. Sparse gradients travel densified and come back sparse;
complex parameters travel as real pairs.
"""
import math
import time

import torch

from torchbearer_dist.sync._autograd import queue_at_backward_end
from torchbearer_dist.sync.flat_buckets import (
    BUCKET_CAP_MB,
    FIRST_BUCKET_MB,
    check_options,
    check_supported,
    pack,
    ready_order,
)
from torchbearer_dist.sync.group import AVG, SUM, WORLD, DistGroup
from torchbearer_dist.sync.powersgd import PowerSGD

_COMPRESSION = {None: None, 'none': None, 'fp16': torch.float16, 'bf16': torch.bfloat16, 'powersgd': None}


def _output_tensors(output):
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _output_tensors(item)]
    return []


class GradientBuckets:
    """Flat gradient buckets for a list of parameters, averaged over a group before backward returns.

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
        group (DistGroup or QuorumGroup): whom gradients are averaged over (:mod:`torchbearer_dist.sync.group`):
            the default process group (:data:`~torchbearer_dist.sync.group.WORLD`) unless given, or a torchft
            quorum's live replicas, whose count may change at every step (the average divides by the count of
            the step)
        reorder (bool): from the second synchronized step on, pack the buckets in the gradient-ready order rank 0
            measured in the first (one broadcast then); False keeps the reverse registration order (a group whose
            members may join between steps, where that broadcast would not match)
        check_finite (bool): after each average, check that it is finite (:attr:`nonfinite`, every gradient then
            None on every rank); False: a non-finite average is left as it is

    Raises:
        ValueError: a bad capacity, compression or overlap; PowerSGD over a group that is no process group

    .. warning:: Every armed backward that synchronizes is a synchronization point.
    """

    def __init__(self, params, bucket_cap_mb=BUCKET_CAP_MB, first_bucket_mb=FIRST_BUCKET_MB, compression=None,
                 overlap='auto', sync_every=1, powersgd=None, average=True, group=None, reorder=True,
                 check_finite=True):
        check_options(bucket_cap_mb, compression, overlap)
        self.group = WORLD if group is None else group
        if compression == 'powersgd' and not isinstance(self.group, DistGroup):
            raise ValueError("compression='powersgd' needs a torch.distributed process group, but given {!r}; use "
                             "compression=None or a DistGroup".format(self.group))
        self.compression = _COMPRESSION[compression]
        self.average = bool(average)
        self.params = list(params)
        check_supported(('#{}'.format(i), p) for i, p in enumerate(self.params))
        # PowerSGD replaces the buckets: it averages every .grad itself at the end of backward.
        self.powersgd = None
        if compression == 'powersgd':
            self.powersgd = PowerSGD(self.params, **dict({'group': self.group.process_group}, **(powersgd or {})))
        self._caps = (bucket_cap_mb, first_bucket_mb)
        self.buckets = [] if self.powersgd else pack(list(reversed(self.params)), bucket_cap_mb, first_bucket_mb)
        self.overlap = len(self.buckets) > 1 if overlap == 'auto' else bool(overlap and not self.powersgd)
        # first synchronized step: parameters in gradient-ready order
        self._ready = [] if self.overlap and reorder else None
        self.check_finite = check_finite
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

    @property
    def world_size(self):
        """The group's size now: the number the average divides by at this step."""
        return self.group.size()

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
        # Uncompressed, the group averages (the flags and the stop slot too: only whether
        # they are > 0 is read); compressed, the values are divided before they travel,
        # so that the narrow dtype's sum cannot overflow.
        if self.compression is None:
            bucket.wire, op = bucket.flat, AVG if self.average else SUM
        else:
            if self.average:
                bucket.grads.div_(self.group.size())
            bucket.wire, op = bucket.flat.to(self.compression), SUM
        bucket.sent = self._unfinished = True
        if self._sent_at is None:
            self._sent_at = time.perf_counter()
        bucket.work = self.group.all_reduce(bucket.wire, op)
        self.bytes_sent += bucket.wire.numel() * bucket.wire.element_size()

    def _wait(self, bucket):
        """Wait for one bucket's all-reduce and leave the average in ``bucket.flat``."""
        begin = time.perf_counter()
        bucket.work.wait()  # a process group's failure raises; a torchft quorum's is torchft's to report
        self._waited_at = time.perf_counter()
        self.wait_seconds += self._waited_at - begin
        if bucket.wire is not bucket.flat:
            bucket.flat.copy_(bucket.wire)

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
                    p.grad.mul_(self.group.size())
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
            self._repack, self._ready = ready_order(self.params, self._ready, self.buckets, self.group), None
        nonfinite = self.check_finite and not self.all_finite()
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

    # --- noticing backward passes: the hooks, a pass's start and its end ---------------------------------

    def attach(self, module=None):
        """Register the hooks that notice backward: per parameter with overlap, else on the modules' outputs.

        Args:
            module (torch.nn.Module or list): the module, or modules, whose outputs backward passes
                start from (a GAN's generator and discriminator); a parameter outside them gets a
                hook of its own, so every backward that reaches a parameter is noticed
        """
        if self._hooks:
            return
        if self.overlap:
            for bucket in self.buckets:
                for position, p in enumerate(bucket.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._overlap_hook(bucket, position)))
            return
        modules = [] if module is None else [module] if isinstance(module, torch.nn.Module) else list(module)
        inside = {id(p) for m in modules for p in m.parameters()}
        for m in modules:
            self._hooks.append(m.register_forward_hook(self._on_forward))
        for p in self.params:
            if id(p) not in inside:  # reached without the model's output, e.g. a learnable loss term
                self._hooks.append(p.register_post_accumulate_grad_hook(self._notice))

    def detach(self):
        """Remove every hook; backward passes then stay local."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.disarm()

    def _on_forward(self, module, inputs, output):
        if self._armed and torch.is_grad_enabled():
            for tensor in _output_tensors(output):
                tensor.register_hook(self._notice)

    def _notice(self, *_):
        if self._armed and not self._in_backward:
            self._begin()

    def _begin(self):
        """The first hook of a backward pass: decide whether it synchronizes, queue its end."""
        self._in_backward = True
        self.began += 1
        self.backwards += 1
        # A second backward in the step (a GAN's discriminator pass) synchronizes again: the gradients
        # averaged before are equal on every rank, so averaging them again leaves them as they are.
        self._syncing = self.backwards % self.sync_every == 0
        end = self._end_sync if self._syncing else self._end_local
        if not queue_at_backward_end(end):
            self._pending_end = end  # run by end_backward(), from the Trial's on_backward

    def end_backward(self):
        """End a backward pass whose end torch could not queue (see :mod:`~torchbearer_dist.sync._autograd`).

        Does nothing when the pass already ended, as it does whenever torch queues the end itself.
        """
        end, self._pending_end = self._pending_end, None
        if end is not None:
            end()

    def complete(self):
        """Make sure this step's gradients are averaged: end a pass whose end torch could not queue, or, where no
        backward of the step synchronized (none reached a parameter on this rank), reduce every bucket now,
        zero-filled, so that this rank issues the same collectives as the others.

        .. warning:: A synchronization point when it reduces.
        """
        self.end_backward()
        if not self.synced:
            self.synced = True
            self.reduce()

    def _end_local(self):
        self._in_backward = False

    def _end_sync(self):
        self._in_backward = False
        self.synced = True
        self.reduce()

    def _overlap_hook(self, bucket, position):
        view = bucket.views[position]

        def on_grad(param):
            if not self._in_backward:
                if not self._armed:
                    return
                self._begin()
            if not self._syncing:
                return
            if bucket.sent:
                raise RuntimeError('a gradient was produced again after its bucket was sent in this backward pass')
            grad = param.grad
            if grad is not view:
                if grad.is_sparse:
                    bucket.put(position, grad)
                else:
                    view.copy_(grad)
                    param.grad = view
            if not bucket.present[position]:
                if self._ready is not None:
                    self._ready.append(param)
                bucket.present[position] = True
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._start_ready()
        return on_grad

    def _start_ready(self):
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._start(buckets[self._next])
            self._next += 1

    def missed(self):
        """Whether this step computed gradients that no hook noticed, so they were never averaged."""
        return self._armed and not self.began and any(p.grad is not None for p in self.params)
