"""The GPU path: one process per GPU, the model wrapped in nccl DistributedDataParallel."""
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from torchbearer_dist.runtime.env import current_env


def wrap_ddp(model, local_rank=None, device=None, **ddp_kwargs):
    """Move ``model`` to this process's GPU and wrap it in DistributedDataParallel.

    DDP then broadcasts rank 0's weights and averages gradients itself, so the Trial runs without
    :class:`~torchbearer_dist.AllReduceGradients`. Without CUDA the model is wrapped for CPU (gloo).
    DDP averages only this model, and only the parameters trainable when it is wrapped: on the DDP
    path (``distributed_callbacks(ddp=True)``) the package averages every other model the Trial holds
    (a GAN's discriminator), and stops every rank if a parameter inside the wrapped model changes
    trainability; set ``requires_grad`` before wrapping.

    Example:

        .. code-block:: python

            env = torchbearer_dist.init_process_group(backend='nccl')
            model = torchbearer_dist.wrap_ddp(Net())
            callbacks = torchbearer_dist.distributed_callbacks(ddp=True)
            trial = Trial(model, optimizer, loss, callbacks=callbacks)
            trial.to(model.device)

        Several ranks sharing one GPU over gloo (a test on a one-GPU machine) name it with ``device``:

        .. code-block:: python

            model = torchbearer_dist.wrap_ddp(Net(), device='cuda:0')  # on every rank

    Args:
        model (torch.nn.Module): the model to wrap
        local_rank (int): GPU index; by default the process group's local rank or ``LOCAL_RANK``
        device (torch.device or str): where the model and DDP run instead of ``cuda:local_rank``:
            ``'cpu'`` (gloo, even where CUDA is available), or a CUDA device (``'cuda'`` alone means
            ``cuda:local_rank``); give it or ``local_rank``, not both
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel`

    Returns:
        torch.nn.parallel.DistributedDataParallel: the wrapped model; ``.device`` is its device

    Raises:
        RuntimeError: no process group is initialized
        ValueError: ``local_rank`` or ``device`` names no visible GPU, ``device`` is neither CPU nor
            CUDA, or both are given
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError('wrap_ddp needs a process group: call torchbearer_dist.init_process_group() first')
    if device is not None and local_rank is not None:
        raise ValueError('give wrap_ddp local_rank or device, not both, but given local_rank={} and device={!r}'.format(
            local_rank, device))
    named = device is not None
    device = _device(device) if named else None
    if device is None or (device.type == 'cuda' and device.index is None):
        if local_rank is None:
            env = current_env()
            local_rank = env.local_rank if env is not None else int(os.environ.get('LOCAL_RANK', '0'))
        device = torch.device('cuda', local_rank) if named or torch.cuda.is_available() else torch.device('cpu')
    if device.type == 'cuda':
        if not 0 <= device.index < torch.cuda.device_count():
            if named:
                visible = 'cuda:0 to cuda:{}'.format(torch.cuda.device_count() - 1) if torch.cuda.device_count() \
                    else "this process sees none: pass device='cpu'"
                raise ValueError('device should name a visible GPU ({}), but given {!r}'.format(visible, str(device)))
            raise ValueError('local_rank should name a visible GPU (0 to {}), but given {}; start one process per '
                             'GPU'.format(torch.cuda.device_count() - 1, device.index))
        torch.cuda.set_device(device)
        wrapped = DistributedDataParallel(model.to(device), device_ids=[device.index], output_device=device.index,
                                          **ddp_kwargs)
    else:
        wrapped = DistributedDataParallel(model.to(device), **ddp_kwargs)
    wrapped.device = device
    return wrapped


def _device(device):
    """``device`` as a :class:`torch.device` of type cpu or cuda; a CUDA one without an index keeps None."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        found = None
    if found is None or found.type not in ('cpu', 'cuda'):
        raise ValueError("device should be 'cpu' or a CUDA device such as 'cuda:0', but given {!r}".format(device))
    return found
