"""A batch's samples: how many it holds, and the padding a DistributedSampler repeats (dropped by ReduceMetrics)."""
import warnings

import torch
import torchbearer
from torch.utils.data import DistributedSampler

from torchbearer_dist.data import distributed_samplers


def _leading(value):
    if isinstance(value, torch.Tensor):
        return value.size(0) if value.dim() > 0 else None
    if isinstance(value, (list, tuple)) and value:
        return _leading(value[0])
    if isinstance(value, dict) and value:
        return _leading(next(iter(value.values())))
    return None


def batch_size(state):
    """The number of samples of the current batch: the first dimension of the targets, else of the inputs.

    Inputs and targets may be tensors, or lists, tuples or dicts of them (the first entry counts).
    """
    for key in (torchbearer.Y_TRUE, torchbearer.X):
        n = _leading(state.get(key))
        if n is not None:
            return n
    return 1


def trim(value, keep):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[:keep]
    if isinstance(value, (list, tuple)):
        return type(value)(trim(v, keep) for v in value)
    if isinstance(value, dict):
        return {k: trim(v, keep) for k, v in value.items()}
    return value


def padding_sampler(loader, rank):
    """The DistributedSampler whose padding ReduceMetrics drops, or None; warns once per pass if it cannot tell.

    ``rank``: this process's in the group the figures are reduced over (None: outside it); the one at 0 warns.

    With several samplers (a wrapper that zips loaders) a batch mixes their shards, and which of its
    samples are padding cannot be told from the batch: none is dropped, and rank 0 warns when some is.
    """
    samplers = [s for s in distributed_samplers(loader) if isinstance(s, DistributedSampler)]
    if len(samplers) <= 1:
        return samplers[0] if samplers else None
    padded = [s for s in samplers if not s.drop_last and len(s.dataset) % s.num_replicas]
    if padded and rank == 0:
        warnings.warn('the loader holds {} DistributedSamplers, so ReduceMetrics cannot tell which samples of a batch '
                      'are the padding a sampler repeats: they count twice; give each dataset a length divisible by '
                      'the number of ranks ({}), or pass drop_last=True to the samplers'.format(
                          len(samplers), samplers[0].num_replicas), stacklevel=3)
    return None
