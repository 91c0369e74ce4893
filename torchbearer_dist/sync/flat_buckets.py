"""One flat buffer of gradients: how parameters are packed into buckets, copied in and handed back.

:mod:`torchbearer_dist.sync.buckets` starts, waits for and averages these buffers; this module only holds
their layout. A bucket holds one real dtype on one device. Complex parameters take two real slots per
value (at an even offset, so that :func:`torch.view_as_complex` can view them), sparse gradients are
copied in densified and handed back sparse, and each bucket ends with one presence flag per
parameter, plus, in the last bucket, a signal slot (:attr:`FlatBucket.signal`, summed over ranks with
the gradients: how many ranks saw their trainable set change) and the stop flag.
"""
import torch

from torchbearer_dist.sync.group import WORLD

#: A bucket's capacity in MiB by default, and the first bucket's: small, so that sending starts early.
BUCKET_CAP_MB, FIRST_BUCKET_MB = 25.0, 1.0


def check_options(bucket_cap_mb, compression, overlap):
    """Raise ValueError, naming the value, for a bad bucket capacity, compression or overlap."""
    if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
        raise ValueError('bucket_cap_mb should be a positive number of MiB, but given {!r}'.format(bucket_cap_mb))
    if compression not in (None, 'none', 'fp16', 'bf16', 'powersgd'):
        raise ValueError("compression should be None, 'fp16', 'bf16' or 'powersgd', but given {!r}".format(
            compression))
    if not (isinstance(overlap, bool) or overlap == 'auto'):
        raise ValueError("overlap should be True, False or 'auto', but given {!r}".format(overlap))


def check_supported(named_params):
    """Raise, naming the parameter, for any parameter whose gradient the buckets cannot average.

    Args:
        named_params (list): ``(name, parameter)`` pairs

    Raises:
        ValueError: a sparse or quantized parameter, or one that is neither floating nor complex
    """
    for name, p in named_params:
        if p.layout != torch.strided or not (p.is_floating_point() or p.is_complex()):
            raise ValueError("parameter '{}' ({}, {}) cannot be averaged by AllReduceGradients: only dense floating "
                             "or complex parameters are; make it dense, or freeze it (requires_grad=False)".format(
                                 name, str(p.dtype).replace('torch.', ''), p.layout))


def _real_dtype(p):
    return p.dtype.to_real() if p.is_complex() else p.dtype


class FlatBucket:
    __slots__ = ('params', 'numel', 'flat', 'grads', 'flags', 'views', 'present', 'pending', 'sent', 'missing',
                 'sparse', 'work', 'wire', 'last', 'signal')

    def __init__(self, params, last):
        self.params = params
        self.last = last
        spans, offset = [], 0
        for p in params:
            if p.is_complex():
                offset += offset % 2  # view_as_complex needs an even storage offset
            spans.append(offset)
            offset += p.numel() * (2 if p.is_complex() else 1)
        self.numel = offset
        self.flat = torch.zeros(offset + len(params) + (2 if last else 0), dtype=_real_dtype(params[0]),
                                device=params[0].device)
        self.grads = self.flat[:offset]
        self.flags = self.flat[offset:offset + len(params)]
        # The last bucket's signal slot, before the stop flag (flat[-1]): what is written there comes back summed.
        self.signal = self.flat[-2:-1] if last else None
        self.views = []
        for p, start in zip(params, spans):
            if p.is_complex():
                self.views.append(torch.view_as_complex(self.flat[start:start + 2 * p.numel()].view(*p.shape, 2)))
            else:
                self.views.append(self.flat[start:start + p.numel()].view_as(p))
        self.present = [False] * len(params)
        self.sparse = {}
        self.reset()

    def reset(self):
        self.present[:] = [False] * len(self.params)
        self.pending = len(self.params)
        self.sent = self.missing = False
        self.work = self.wire = None

    def put(self, position, grad):
        """Copy one gradient in (densified if sparse) and make it the parameter's ``.grad``."""
        view = self.views[position]
        if grad.is_sparse:
            view.copy_(grad.to_dense())
            self.sparse[position] = grad.sparse_dim()
        elif grad is not view:
            view.copy_(grad)
        self.params[position].grad = view

    def fill(self):
        """Copy in every gradient not yet in; zero-fill the missing ones.

        Returns:
            bool: whether a gradient was missing (None) on this rank
        """
        if self.pending == len(self.params):
            grads = [p.grad for p in self.params]
            if not any(grad is None or grad.is_sparse for grad in grads):  # the common case: every gradient dense
                for view, grad in zip(self.views, grads):
                    if grad.data_ptr() != view.data_ptr():  # a gradient already in its view stays
                        view.copy_(grad)
                self.pending = 0
                return False
        missing = False
        for position, p in enumerate(self.params):
            if self.present[position]:
                continue
            if p.grad is None:
                self.views[position].zero_()
                missing = True
            else:
                self.present[position] = True
                self.put(position, p.grad)
        self.pending = 0
        return missing

    def unpack(self):
        """Hand the averaged values back as ``.grad``; None for a parameter that no rank used."""
        used = None if not self.missing or self.flags.min().item() > 0 else self.flags.tolist()
        for position, (p, view) in enumerate(zip(self.params, self.views)):
            if used is not None and not used[position]:
                p.grad = None
            elif position in self.sparse:
                p.grad = view.to_sparse(sparse_dim=self.sparse[position])
            elif p.grad is not view:
                p.grad = view
        self.sparse.clear()


def pack(params, cap_mb, first_mb):
    """Group ``params`` (in the order their gradients are expected) into :class:`FlatBucket` s.

    A bucket is closed *after* the tensor that fills it to ``cap_mb`` (``first_mb`` for the first
    one), as DDP does, and before every change of real dtype or device. Closing after, not before,
    keeps a large tensor that is ready early (the first Linear layer of a CNN, whose gradient comes
    right after the last layer's) in the bucket that leaves during backward, instead of holding it
    back, with everything else, for the last gradient of backward.
    """
    buckets, current, size = [], [], 0
    cap = first_mb * 2 ** 20 if first_mb else cap_mb * 2 ** 20
    for p in params:
        if current and (_real_dtype(p) != _real_dtype(current[0]) or p.device != current[0].device):
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2 ** 20
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2 ** 20
    if current:
        buckets.append(current)
    return [FlatBucket(b, i == len(buckets) - 1) for i, b in enumerate(buckets)]


def ready_order(params, ready, buckets, group=WORLD):
    """Rank 0's gradient-ready order of ``params``, shared by one broadcast; None if the buckets follow it already.

    Args:
        params (list): every parameter, in registration order
        ready (list): the parameters in the order their gradients arrived in a step on this rank
        buckets (list of FlatBucket): the current buckets, in sending order
        group (DistGroup): whose first rank's order every rank takes

    Returns:
        list: the parameters in rank 0's order (those that never arrived last, in reverse registration
        order), or None when the current buckets already hold them in that order

    .. warning:: A synchronization point: every rank must call it at the same step.
    """
    index = {id(p): i for i, p in enumerate(params)}
    seen = [index[id(p)] for p in ready]
    arrived = set(seen)
    unseen = [i for i in reversed(range(len(params))) if i not in arrived]
    order = torch.tensor(seen + unseen, dtype=torch.int64, device=buckets[0].flat.device)
    group.broadcast(order).wait()
    order = order.tolist()
    if order == [index[id(p)] for bucket in buckets for p in bucket.params]:
        return None
    return [params[i] for i in order]
