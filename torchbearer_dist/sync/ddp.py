"""The GPU path: one process per GPU, the model wrapped in nccl DistributedDataParallel."""
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from torchbearer_dist.runtime.env import current_env


def wrap_ddp(model, local_rank=None, **ddp_kwargs):
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

    Args:
        model (torch.nn.Module): the model to wrap
        local_rank (int): GPU index; by default the process group's local rank or ``LOCAL_RANK``
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel`

    Returns:
        torch.nn.parallel.DistributedDataParallel: the wrapped model; ``.device`` is its device

    Raises:
        RuntimeError: no process group is initialized
        ValueError: ``local_rank`` names no visible GPU
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError('wrap_ddp needs a process group: call torchbearer_dist.init_process_group() first')
    if local_rank is None:
        env = current_env()
        local_rank = env.local_rank if env is not None else int(os.environ.get('LOCAL_RANK', '0'))
    if torch.cuda.is_available():
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError('local_rank should name a visible GPU (0 to {}), but given {}; start one process per '
                             'GPU'.format(torch.cuda.device_count() - 1, local_rank))
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
        wrapped = DistributedDataParallel(model.to(device), device_ids=[local_rank], output_device=local_rank,
                                          **ddp_kwargs)
    else:
        device = torch.device('cpu')
        wrapped = DistributedDataParallel(model, **ddp_kwargs)
    wrapped.device = device
    return wrapped
