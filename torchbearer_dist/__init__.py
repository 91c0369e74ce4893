"""torchbearer_dist: make a standard torchbearer Trial train data-parallel by adding callbacks."""
from torchbearer_dist.callbacks.broadcast import BroadcastParameters
from torchbearer_dist.callbacks.comm_report import CommunicationReport
from torchbearer_dist.callbacks.even_batches import EvenBatches
from torchbearer_dist.callbacks.gradients import SKIPPED_STEPS, AllReduceGradients
from torchbearer_dist.callbacks.images import FlattenImages
from torchbearer_dist.callbacks.low_communication import DiLoCo
from torchbearer_dist.callbacks.lr_scaling import LR_FACTOR, ScaleLearningRate
from torchbearer_dist.callbacks.metrics import ReduceMetrics, reduce_metric
from torchbearer_dist.callbacks.output import RankZeroOnly, RankZeroOutput
from torchbearer_dist.callbacks.replicas import CheckReplicas
from torchbearer_dist.callbacks.sampler import SetSamplerEpoch
from torchbearer_dist.callbacks.stop import AgreeOnStop
from torchbearer_dist.checkpoint.callback import Checkpoint
from torchbearer_dist.checkpoint.files import load_checkpoint, save_checkpoint
from torchbearer_dist.data import check_same_data, distributed_loader, distributed_samplers
from torchbearer_dist.ft import FaultTolerantAllReduce, Lighthouse
from torchbearer_dist.recipe import distributed_callbacks
from torchbearer_dist.runtime.env import DEFAULT_RENDEZVOUS_TIMEOUT, DEFAULT_TIMEOUT, DistEnv, current_env, resolve
from torchbearer_dist.runtime.errors import EXIT_PREEMPTED, PeerFailedError, Preempted, quiet_peer_failures
from torchbearer_dist.runtime.group import destroy_process_group, init_process_group, process_group
from torchbearer_dist.runtime.interrupts import (
    unwatch_interrupts,
    unwatch_preemption,
    watch_interrupts,
    watch_preemption,
)
from torchbearer_dist.runtime.launcher import launch
from torchbearer_dist.sync.collectives import rank as get_rank
from torchbearer_dist.sync.collectives import world_size as get_world_size
from torchbearer_dist.sync.ddp import wrap_ddp
from torchbearer_dist.sync.gather import all_gather_rows, gather_predictions
from torchbearer_dist.sync.powersgd import PowerSGD
from torchbearer_dist.sync.syncbn import SyncBatchNorm, convert_sync_batchnorm

__version__ = '0.1.0'


def is_main_process():
    """True on global rank 0, and in a job of one process: where to print and save."""
    return get_rank() == 0


__all__ = ['AgreeOnStop', 'AllReduceGradients', 'BroadcastParameters', 'CheckReplicas', 'Checkpoint',
           'CommunicationReport',
           'DEFAULT_RENDEZVOUS_TIMEOUT', 'DEFAULT_TIMEOUT', 'DiLoCo', 'DistEnv', 'EXIT_PREEMPTED', 'EvenBatches',
           'FaultTolerantAllReduce', 'FlattenImages', 'LR_FACTOR', 'Lighthouse',
           'PeerFailedError', 'PowerSGD', 'Preempted', 'RankZeroOnly', 'RankZeroOutput',
           'ReduceMetrics', 'SKIPPED_STEPS', 'ScaleLearningRate', 'SetSamplerEpoch', 'SyncBatchNorm',
           'all_gather_rows', 'check_same_data', 'convert_sync_batchnorm', 'current_env', 'destroy_process_group',
           'distributed_callbacks', 'distributed_loader', 'distributed_samplers', 'gather_predictions', 'get_rank',
           'get_world_size', 'init_process_group', 'is_main_process', 'launch', 'load_checkpoint', 'process_group',
           'quiet_peer_failures', 'reduce_metric', 'resolve', 'save_checkpoint', 'unwatch_interrupts',
           'unwatch_preemption',
           'watch_interrupts', 'watch_preemption', 'wrap_ddp', '__version__']
