"""Bucketed gradient all-reduce: the engine behind :class:`~torchbearer_dist.AllReduceGradients`.

Parameters are packed, in reverse registration order (roughly the order backward produces their
gradients), into flat buckets of at most ``bucket_cap_mb``. Gradients are copied into their bucket
and ``param.grad`` becomes a view of it, so there is no copy beyond the buckets and the optimizer
reads the averaged values in place.

Two ways to fill the buckets:

- *Overlapped*: an autograd post-accumulate-grad hook on each parameter copies its gradient in;
  once every gradient of a bucket is in, the bucket's all-reduce starts asynchronously while
  backward goes on computing the rest, as in DDP.
- *After backward*: :meth:`GradientBuckets.finish` fills every bucket with one fused copy per bucket
  (``torch._foreach_copy_``) and starts them all. No Python runs per parameter during backward.

A hook costs a few microseconds of Python per parameter, and a bucket can only overlap backward if
another bucket comes after it, so ``overlap='auto'`` (the default) uses hooks only when the
parameters span more than one bucket. :meth:`GradientBuckets.finish` waits for every bucket and
averages.

Buckets start strictly in index order on every rank, so ranks always issue the same collectives in
the same order even when gradients arrive in a different order. Each bucket also carries one
presence flag per parameter: a gradient that is None on this rank is zero-filled, and a parameter
that no rank used keeps ``grad = None``, as it would without distribution. The last bucket carries
one more slot, a stop flag, so that a stop requested on any rank reaches all of them without an
extra collective.
"""
import math

import torch
import torch.distributed as dist

_COMPRESSION = {None: None, 'none': None, 'fp16': torch.float16, 'bf16': torch.bfloat16}


class _Bucket:
    __slots__ = ('params', 'numel', 'flat', 'grads', 'flags', 'views', 'present', 'pending', 'sent', 'missing',
                 'work', 'wire', 'last')

    def __init__(self, params, last):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.last = last
        self.flat = torch.zeros(self.numel + len(params) + (1 if last else 0), dtype=first.dtype,
                                device=first.device)
        self.grads = self.flat[:self.numel]
        self.flags = self.flat[self.numel:self.numel + len(params)]
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.present = [False] * len(params)
        self.reset()

    def reset(self):
        self.present[:] = [False] * len(self.params)
        self.pending = len(self.params)
        self.sent = self.missing = False
        self.work = self.wire = None

    def fill(self):
        """Copy in every gradient not yet in, with one fused copy; zero-fill the missing ones.

        Returns:
            bool: whether a gradient was missing (None) on this rank
        """
        if self.pending == len(self.params):
            grads = [p.grad for p in self.params]
            if not any(grad is None for grad in grads):  # the common case: no Python per parameter
                torch._foreach_copy_(self.views, grads)  # copying a view onto itself is a no-op
                self.pending = 0
                return False
        missing = False
        sources, targets = [], []
        for position, p in enumerate(self.params):
            if self.present[position]:
                continue
            grad = p.grad
            view = self.views[position]
            if grad is None:
                view.zero_()
                missing = True
                continue
            self.present[position] = True
            if grad is not view:
                sources.append(grad)
                targets.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)
        self.pending = 0
        return missing


class GradientBuckets:
    """Flat gradient buckets for a list of parameters, all-reduced during or right after backward.

    Example:

        .. code-block:: python

            buckets = GradientBuckets(list(model.parameters()))
            buckets.attach()
            loss.backward()     # with overlap, all-reduces start during backward
            buckets.finish()    # send the rest, wait: every p.grad holds the average over ranks
            buckets.detach()

    Args:
        params (list of torch.nn.Parameter): the parameters to synchronize, in registration order
        bucket_cap_mb (float): capacity of a bucket in MiB
        first_bucket_mb (float): capacity of the first bucket to start (the last layers'
            gradients), small so that communication starts early, as in DDP
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in;
            they are averaged back in their own dtype
        overlap (bool or str): ``True`` starts each bucket from autograd hooks during backward,
            ``False`` fills and starts every bucket in :meth:`finish`, ``'auto'`` overlaps only
            when the parameters span more than one bucket

    Raises:
        ValueError: a bad capacity, compression or overlap
    """

    def __init__(self, params, bucket_cap_mb=25.0, first_bucket_mb=1.0, compression=None, overlap='auto'):
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError('bucket_cap_mb should be a positive number of MiB, but given {!r}'.format(bucket_cap_mb))
        if compression not in _COMPRESSION:
            raise ValueError("compression should be None, 'fp16' or 'bf16', but given {!r}".format(compression))
        if not (isinstance(overlap, bool) or overlap == 'auto'):
            raise ValueError("overlap should be True, False or 'auto', but given {!r}".format(overlap))
        self.compression = _COMPRESSION[compression]
        self.world_size = dist.get_world_size()
        self.params = list(params)
        self.buckets = self._pack(list(reversed(self.params)), bucket_cap_mb, first_bucket_mb)
        self.overlap = len(self.buckets) > 1 if overlap == 'auto' else overlap
        self._hooks = []
        self._next = 0
        self._stop = 0.0
        self.enabled = True

    def _pack(self, params, cap_mb, first_mb):
        buckets, current, size = [], [], 0
        cap = first_mb * 2 ** 20 if first_mb else cap_mb * 2 ** 20
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(current)
                current, size, cap = [], 0, cap_mb * 2 ** 20
            current.append(p)
            size += nbytes
        if current:
            buckets.append(current)
        return [_Bucket(b, i == len(buckets) - 1) for i, b in enumerate(buckets)]

    def attach(self):
        """With overlap, register the autograd hooks that start all-reduces during backward."""
        if self.overlap and not self._hooks:
            for bucket in self.buckets:
                for position, p in enumerate(bucket.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket, position)))

    def detach(self):
        """Remove the hooks; gradients then stay local until :meth:`finish` is called."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def request_stop(self):
        """Ask every rank to stop; :meth:`finish` of this step returns True on all of them."""
        self._stop = 1.0

    def _hook(self, bucket, position):
        view = bucket.views[position]
        present = bucket.present

        def on_grad(param):
            if not self.enabled:
                return
            if bucket.sent:
                raise RuntimeError('a gradient was produced again after its bucket was sent in this step; call '
                                   'backward once per step, or sync only every k-th backward (sync_every=k)')
            grad = param.grad
            if grad is not view:
                view.copy_(grad)
                param.grad = view
            if not present[position]:
                present[position] = True
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch_ready()
        return on_grad

    def _launch(self, bucket, missing=False):
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
            bucket.grads.div_(self.world_size)
            bucket.wire = bucket.flat.to(self.compression)
        bucket.sent = True
        bucket.work = dist.all_reduce(bucket.wire, async_op=True)

    def _launch_ready(self):
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._launch(buckets[self._next])
            self._next += 1

    def finish(self):
        """Send what backward left unsent, wait for every bucket and average.

        Returns:
            bool: True when any rank asked to stop in this step

        .. warning:: A synchronization point: every rank must call it once per step.
        """
        buckets = self.buckets
        for bucket in buckets[self._next:]:
            self._launch(bucket, bucket.fill())
        stop = False
        for bucket in buckets:
            bucket.work.wait()
            if bucket.wire is not bucket.flat:
                bucket.flat.copy_(bucket.wire)
            else:
                bucket.grads.div_(self.world_size)
            views = bucket.views
            if not bucket.missing or bucket.flags.min().item() > 0:  # every parameter was used on some rank
                for p, view in zip(bucket.params, views):
                    if p.grad is not view:
                        p.grad = view
            else:
                for position, used in enumerate(bucket.flags.tolist()):
                    bucket.params[position].grad = views[position] if used else None
            if bucket.last:
                stop = bucket.flat[-1].item() > 0
            bucket.reset()
        self._next = 0
        self._stop = 0.0
        return stop

    def all_finite(self):
        """Whether every averaged gradient is finite; identical on all ranks after :meth:`finish`.

        A sum is finite whenever every value is, unless it overflows: one fast sum per bucket, and
        the exact elementwise check (ten times slower) only for a bucket whose sum is not finite.
        """
        for bucket in self.buckets:
            if not math.isfinite(bucket.grads.sum().item()) and not bool(torch.isfinite(bucket.grads).all()):
                return False
        return True

    def clear(self):
        """Drop this step's gradients (``grad = None``) so the optimizer skips them."""
        for p in self.params:
            p.grad = None
