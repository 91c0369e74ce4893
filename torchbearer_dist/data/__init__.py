"""Data across ranks: a correctly sharded loader, finding the samplers that shard one, checking that every
rank was given the same data, and the rest of an epoch for a resume in mid-epoch.

- :mod:`~torchbearer_dist.data.loaders`: :func:`distributed_loader`, :func:`distributed_samplers`
- :mod:`~torchbearer_dist.data.consistency`: :func:`check_same_data`, the data sentinel
- :mod:`~torchbearer_dist.data.resume`: :func:`remaining_indices`
"""
from torchbearer_dist.data.consistency import check_same_data
from torchbearer_dist.data.loaders import describe_search, distributed_loader, distributed_sampler, distributed_samplers
from torchbearer_dist.data.resume import remaining_indices, resumable

__all__ = ['check_same_data', 'describe_search', 'distributed_loader', 'distributed_sampler', 'distributed_samplers',
           'remaining_indices', 'resumable']
