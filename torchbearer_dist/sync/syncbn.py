"""Synchronized BatchNorm that also runs on CPU over gloo: statistics of the union of every rank's batch.

torch's :class:`torch.nn.SyncBatchNorm` refuses CPU tensors. Here each layer's forward all-reduces
one fused float64 tensor ``[sum, sum of squares, count]`` and its backward one ``[sum(dy),
sum(dy * (x - mean))]``, so the normalization, its exact gradient and the running statistics are
those of one process at the global batch, on any device and backend (one code path, tested on CPU).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from torchbearer_dist.sync import _batchnorm

#: The layers :func:`convert_sync_batchnorm` replaces (torch's own CUDA-only SyncBatchNorm included).
CONVERTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the union of the group's batches, with one all-reduce each way."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        channels = input.size(1)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        compute = torch.float64 if input.dtype == torch.float64 else torch.float32
        x = input.to(compute)
        count = input.numel() // channels
        if count > 0:
            # Each rank's mean and centered sum of squares (two passes, exact in the input precision),
            # then Chan's combine carried in float64: the all-reduced sums of x and x**2 lose nothing.
            mean = x.mean(dims)
            m2 = (x - mean.view(shape)).square_().sum(dims).double()
            mean = mean.double()
            local = torch.cat([mean * count, m2 + mean * mean * count, mean.new_tensor([count])])
        else:
            local = torch.zeros(2 * channels + 1, dtype=torch.float64, device=input.device)
        dist.all_reduce(local, group=group)
        total = local[-1].item()
        if total <= 1:
            raise ValueError('Expected more than 1 value per channel when training, got {:.0f} over all ranks '
                             '(input size {} here); use larger batches'.format(total, list(input.shape)))
        mean = local[:channels] / total
        var = (local[channels:2 * channels] / total - mean * mean).clamp_(min=0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        mean, invstd = mean.to(compute), (var + eps).rsqrt().to(compute)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.group, ctx.total = group, total
        # The elementwise affine normalization with the global statistics, in torch's native kernel.
        output = F.batch_norm(x, mean, var.to(compute), None if weight is None else weight.to(compute),
                              None if bias is None else bias.to(compute), False, 0.0, eps)
        return output.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        channels = input.size(1)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        compute = mean.dtype
        dy = grad_output.to(compute)
        sum_dy = dy.sum(dims)
        centered = input.to(compute) - mean.view(shape)
        sum_dy_centered = (centered * dy).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_centered * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_output.dtype)
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_centered]).double()
            dist.all_reduce(both, group=ctx.group)
            mean_dy = (both[:channels] / ctx.total).to(compute)
            mean_dy_centered = (both[channels:] / ctx.total).to(compute)
            # dx = scale * (dy - mean(dy) - (x - mean) * invstd**2 * mean(dy * (x - mean))) in two fused passes.
            scale = invstd if weight is None else invstd * weight.to(compute)
            slope = invstd * invstd * mean_dy_centered * scale
            grad_input = torch.addcmul((-mean_dy * scale).view(shape), centered, -slope.view(shape))
            grad_input = grad_input.addcmul_(dy, scale.view(shape)).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


# torch's private BatchNorm base, the one its own SyncBatchNorm extends (see sync/_batchnorm.py). Its
# bias= keyword is accepted from torch 2.13, the floor (tests/sync/test_syncbn_versions.py runs in both
# CI configurations).
class SyncBatchNorm(_batchnorm.base()):
    """BatchNorm whose training statistics are those of every rank's batch together, on CPU or GPU.

    Made by :func:`convert_sync_batchnorm`; takes the arguments of :class:`torch.nn.SyncBatchNorm`.
    In training each forward costs one all-reduce of ``2 * num_features + 1`` float64 values and
    each backward one of ``2 * num_features``. In eval mode, in a job of one process, and with
    ``track_running_stats=False`` in eval mode it is plain BatchNorm and communicates nothing. CUDA
    inputs take the same path (torch's :class:`torch.nn.SyncBatchNorm` is not called).

    Example:

        .. code-block:: python

            layer = torchbearer_dist.SyncBatchNorm(16)   # or convert_sync_batchnorm(model)
            y = layer(x)  # x: (N, 16, ...) on this rank; statistics over every rank's N

    Args:
        num_features (int): channels, ``C`` of an ``(N, C, ...)`` input
        eps (float): added to the variance
        momentum (float): weight of each batch in the running statistics; ``None``: cumulative average
        affine (bool): learn a per-channel weight and bias
        track_running_stats (bool): keep running statistics for eval mode
        process_group (torch.distributed.ProcessGroup): the ranks whose batches are pooled; default every rank
        device (torch.device): where parameters and buffers are created
        dtype (torch.dtype): their dtype
        bias (bool): with ``affine``, learn the bias too

    Raises:
        ValueError: an input of fewer than 2 dimensions or 0 channels, or, in training, at most one
            value per channel over all ranks (raised on every rank alike)

    .. warning:: A synchronization point at every training forward and backward: every rank of the
        group must run them, each with a batch (a rank may bring 0 samples, the group at least 2).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None, bias=True):
        # bias=False reaches torch's base only when asked: that keyword is torch 2.13's
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         **({} if bias else {'bias': False}))
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError('expected at least 2D input (got {}D input)'.format(input.dim()))

    def _check_non_zero_input_channels(self, input):
        if input.size(1) == 0:
            raise ValueError('SyncBatchNorm number of input channels should be non-zero')

    def _group_size(self):
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def forward(self, input):
        need_sync = self.training and self._group_size() > 1
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not need_sync:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, momentum,
                                self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            momentum, self.process_group or dist.group.WORLD)


def convert_sync_batchnorm(module, process_group=None):
    """Replace every BatchNorm1d, 2d and 3d layer of ``module`` with a :class:`SyncBatchNorm`.

    Like :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`, but the layers also work on CPU
    over gloo. Each new layer keeps the old one's parameters and buffers (the same tensors), its
    ``eps``, ``momentum`` (``None``: cumulative average), ``affine``, ``track_running_stats`` and
    training flag, so ``state_dict`` keys and values are unchanged. In training, the layers
    normalize with the mean and variance of the union of every rank's batch and update the running
    statistics as one process at the global batch would (unbiased variance over the global count);
    gradients flow exactly through those statistics.

    Convert before creating the optimizer (and before :func:`~torchbearer_dist.wrap_ddp`); it
    composes with :func:`~torchbearer_dist.distributed_callbacks` and with DistributedDataParallel
    on CPU, which treats the layers as plain BatchNorm.

    Example:

        .. code-block:: python

            model = torchbearer_dist.convert_sync_batchnorm(Net())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            callbacks = torchbearer_dist.distributed_callbacks()
            trial = Trial(model, optimizer, loss, callbacks=callbacks)

    Args:
        module (torch.nn.Module): a model holding BatchNorm layers, or one BatchNorm layer
        process_group (torch.distributed.ProcessGroup): the ranks whose batches are pooled; default
            every rank (or, for a :class:`torch.nn.SyncBatchNorm`, its own group)

    Returns:
        torch.nn.Module: ``module`` with its layers replaced in place, or a new :class:`SyncBatchNorm`
        when ``module`` itself is a BatchNorm layer

    Raises:
        ValueError: ``module`` is not a :class:`torch.nn.Module`

    .. warning:: Every training forward and backward of a converted layer is a synchronization
        point: every rank must train the same steps (see :class:`~torchbearer_dist.EvenBatches`).
    """
    if not isinstance(module, nn.Module):
        raise ValueError('module should be a torch.nn.Module, but given {!r}'.format(type(module).__name__))
    converted = module
    if isinstance(module, CONVERTED) and not isinstance(module, SyncBatchNorm):
        group = process_group if process_group is not None else getattr(module, 'process_group', None)
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, group,
                                  bias=getattr(module, 'bias', None) is not None or not module.affine)
        converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, 'qconfig'):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
