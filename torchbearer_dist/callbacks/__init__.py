"""Every torchbearer :class:`~torchbearer.callbacks.Callback` of the package, one concern per module.

Each works with no arguments once the process group is up, and does nothing in a job of one
process, so the same Trial runs unchanged with and without distribution.
:func:`~torchbearer_dist.distributed_callbacks` (in :mod:`torchbearer_dist.recipe`, a layer above this one and
:mod:`torchbearer_dist.ft`) returns the standard set.
"""
from torchbearer_dist.callbacks.broadcast import BroadcastParameters
from torchbearer_dist.callbacks.comm_report import CommunicationReport
from torchbearer_dist.callbacks.even_batches import EvenBatches
from torchbearer_dist.callbacks.gradients import SKIPPED_STEPS, AllReduceGradients
from torchbearer_dist.callbacks.images import FlattenImages
from torchbearer_dist.callbacks.low_communication import DiLoCo
from torchbearer_dist.callbacks.lr_scaling import LR_FACTOR, ScaleLearningRate
from torchbearer_dist.callbacks.metrics import ReduceMetrics
from torchbearer_dist.callbacks.output import RankZeroOnly, RankZeroOutput
from torchbearer_dist.callbacks.replicas import CheckReplicas
from torchbearer_dist.callbacks.sampler import SetSamplerEpoch
from torchbearer_dist.callbacks.stop import AgreeOnStop

__all__ = ['LR_FACTOR', 'SKIPPED_STEPS', 'AgreeOnStop', 'AllReduceGradients', 'BroadcastParameters', 'CheckReplicas',
           'CommunicationReport',
           'DiLoCo',
           'EvenBatches', 'FlattenImages', 'RankZeroOnly', 'RankZeroOutput', 'ReduceMetrics', 'ScaleLearningRate',
           'SetSamplerEpoch']
