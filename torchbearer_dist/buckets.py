"""Bucketed, overlapped gradient all-reduce: the engine behind :class:`~torchbearer_dist.AllReduceGradients`.

Parameters are packed, in reverse registration order (roughly the order backward produces their
gradients), into flat buckets of at most ``bucket_cap_mb``. An autograd post-accumulate-grad hook
on each parameter copies its gradient into its bucket and makes ``param.grad`` a view of it; once
every gradient of a bucket is in, the bucket's all-reduce starts asynchronously, while backward
goes on computing the rest. :meth:`GradientBuckets.finish` waits for them all and averages.

Buckets start strictly in index order on every rank, so ranks always issue the same collectives in
the same order even when gradients arrive in a different order. Each bucket also carries one
presence flag per parameter: a gradient that is None on this rank is zero-filled, and a parameter
that no rank used keeps ``grad = None``, as it would without distribution. The last bucket carries
one more slot, a stop flag, so that a stop requested on any rank reaches all of them without an
extra collective.
"""
import torch
import torch.distributed as dist

_COMPRESSION = {None: None, 'none': None, 'fp16': torch.float16, 'bf16': torch.bfloat16}


class _Bucket:
    def __init__(self, params, extra_slots):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.flat = torch.zeros(self.numel + len(params) + extra_slots, dtype=first.dtype, device=first.device)
        self.grads = self.flat[:self.numel]
        self.flags = self.flat[self.numel:self.numel + len(params)]
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.work = None
        self.wire = None


class GradientBuckets:
    """Flat gradient buckets for a list of parameters, all-reduced as backward fills them.

    Example:

        .. code-block:: python

            buckets = GradientBuckets(list(model.parameters()))
            buckets.attach()
            loss.backward()     # all-reduces start during backward
            buckets.finish()    # wait, then every p.grad holds the average over ranks
            buckets.detach()

    Args:
        params (list of torch.nn.Parameter): the parameters to synchronize, in registration order
        bucket_cap_mb (float): capacity of a bucket in MiB
        first_bucket_mb (float): capacity of the first bucket to start (the last layers'
            gradients), small so that communication starts early, as in DDP
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in;
            they are averaged back in their own dtype

    Raises:
        ValueError: a bad capacity or compression
    """

    def __init__(self, params, bucket_cap_mb=25.0, first_bucket_mb=1.0, compression=None):
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError('bucket_cap_mb should be a positive number of MiB, but given {!r}'.format(bucket_cap_mb))
        if compression not in _COMPRESSION:
            raise ValueError("compression should be None, 'fp16' or 'bf16', but given {!r}".format(compression))
        self.compression = _COMPRESSION[compression]
        self.world_size = dist.get_world_size()
        self.params = list(params)
        self.buckets = self._pack(list(reversed(self.params)), bucket_cap_mb, first_bucket_mb)
        self.slot = {}
        for index, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                self.slot[p] = (index, position)
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
        return [_Bucket(b, 1 if i == len(buckets) - 1 else 0) for i, b in enumerate(buckets)]

    def attach(self):
        """Register the autograd hooks that start all-reduces during backward."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def detach(self):
        """Remove the hooks; gradients then stay local until :meth:`finish` is called."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def request_stop(self):
        """Ask every rank to stop; :meth:`finish` of this step returns True on all of them."""
        self._stop = 1.0

    def _on_grad(self, param):
        if not self.enabled:
            return
        index, position = self.slot[param]
        bucket = self.buckets[index]
        if index < self._next:
            raise RuntimeError('a gradient was produced again after its bucket was sent in this step; call '
                               'backward once per step, or sync only every k-th backward (sync_every=k)')
        view = bucket.views[position]
        if not bucket.ready[position]:
            bucket.ready[position] = True
            bucket.pending -= 1
            bucket.flags[position] = 1
        grad = param.grad
        if grad is not view:
            view.copy_(grad)
            param.grad = view
        if bucket.pending == 0:
            self._launch_ready()

    def _launch(self, bucket):
        if bucket is self.buckets[-1]:
            bucket.flat[-1] = self._stop
        if self.compression is None:
            bucket.wire = bucket.flat
        else:
            bucket.grads.div_(self.world_size)
            bucket.wire = bucket.flat.to(self.compression)
        bucket.work = dist.all_reduce(bucket.wire, async_op=True)

    def _launch_ready(self):
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def finish(self):
        """Send what backward left unsent, wait for every bucket and average.

        Returns:
            bool: True when any rank asked to stop in this step

        .. warning:: A synchronization point: every rank must call it once per step.
        """
        for bucket in self.buckets[self._next:]:
            if bucket.pending:
                for position, ready in enumerate(bucket.ready):
                    if not ready:
                        bucket.views[position].zero_()
                bucket.pending = 0
        self._launch_ready()
        stop = False
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.wire is not bucket.flat:
                bucket.flat.copy_(bucket.wire)
            else:
                bucket.grads.div_(self.world_size)
            used = bucket.flags.tolist()
            for position, p in enumerate(bucket.params):
                p.grad = bucket.views[position] if used[position] else None
            if bucket is self.buckets[-1]:
                stop = bucket.flat[-1].item() > 0
            bucket.flags.zero_()
            bucket.ready = [False] * len(bucket.params)
            bucket.pending = len(bucket.params)
            bucket.work = bucket.wire = None
        self._next = 0
        self._stop = 0.0
        return stop

    def all_finite(self):
        """Whether every averaged gradient is finite; identical on all ranks after :meth:`finish`."""
        return bool(torch.stack([torch.isfinite(b.grads).all() for b in self.buckets]).all())

    def clear(self):
        """Drop this step's gradients (``grad = None``) so the optimizer skips them."""
        for p in self.params:
            p.grad = None
