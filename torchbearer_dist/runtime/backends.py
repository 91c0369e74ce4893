"""Which torch.distributed backend a job uses: gloo unless nccl is asked for or the model is on CUDA."""
import torch
import torch.distributed as dist

BACKENDS = ('gloo', 'nccl', 'mpi')


def default_backend(device=None, cuda_available=None):
    """The backend when none is asked for: ``'nccl'`` for a model on CUDA, ``'gloo'`` otherwise.

    Having a GPU is no reason for nccl: CPU tensors fail under it. :func:`torchbearer_dist.launch`
    and :func:`torchbearer_dist.process_group` start before any model exists, so they use gloo
    unless given ``backend='nccl'``; pass ``backend=default_backend(model)`` to follow the model.

    Example: ::

        >>> default_backend(torch.nn.Linear(2, 1))
        'gloo'
        >>> default_backend('cuda:0', cuda_available=True)
        'nccl'

    Args:
        device (torch.nn.Module or torch.device or str): the model, or its device; None if not known
        cuda_available (bool): whether this process sees CUDA; by default :func:`torch.cuda.is_available`

    Returns:
        str: the backend name
    """
    if isinstance(device, torch.nn.Module):
        tensor = next(iter(device.parameters()), next(iter(device.buffers()), None))
        device = None if tensor is None else tensor.device
    if device is None:
        return 'gloo'
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    return 'nccl' if cuda_available and torch.device(device).type == 'cuda' else 'gloo'


def check_backend(backend):
    """Check that ``backend`` names a backend this process can use.

    Args:
        backend (str): ``'gloo'``, ``'nccl'`` or ``'mpi'``

    Returns:
        str: the backend, lower-cased

    Raises:
        ValueError: when the backend is unknown, not built into this torch, or nccl without CUDA
    """
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError('backend should be one of {}, but given {!r}; use gloo on CPUs and nccl on GPUs'.format(
            ', '.join(BACKENDS), backend))
    backend = backend.lower()
    if backend == 'nccl' and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device, but this process sees none; "
                         "use backend='gloo' on CPU machines")
    if not getattr(dist, 'is_{}_available'.format(backend))():
        raise ValueError('backend {!r} is not available in this build of torch {}; use gloo instead'.format(
            backend, torch.__version__))
    return backend
