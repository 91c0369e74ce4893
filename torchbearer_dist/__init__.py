"""torchbearer_dist: make a standard torchbearer Trial train data-parallel by adding callbacks."""
from torchbearer_dist.callbacks import (
    SKIPPED_STEPS,
    AgreeOnStop,
    AllReduceGradients,
    BroadcastParameters,
    FlattenImages,
    SetSamplerEpoch,
    distributed_callbacks,
)
from torchbearer_dist.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from torchbearer_dist.comm import rank as get_rank
from torchbearer_dist.comm import world_size as get_world_size
from torchbearer_dist.consistency import CheckReplicas, EvenBatches
from torchbearer_dist.data import distributed_loader
from torchbearer_dist.ddp import wrap_ddp
from torchbearer_dist.diagnosis import PeerFailedError
from torchbearer_dist.env import DEFAULT_RENDEZVOUS_TIMEOUT, DEFAULT_TIMEOUT, DistEnv, resolve
from torchbearer_dist.gather import all_gather_rows, gather_predictions
from torchbearer_dist.group import destroy_process_group, init_process_group, process_group
from torchbearer_dist.interrupts import unwatch_interrupts, watch_interrupts
from torchbearer_dist.launcher import launch
from torchbearer_dist.lr_scaling import LR_FACTOR, ScaleLearningRate
from torchbearer_dist.metrics import ReduceMetrics
from torchbearer_dist.output import RankZeroOnly, RankZeroOutput
from torchbearer_dist.powersgd import PowerSGD
from torchbearer_dist.rendezvous import current_env
from torchbearer_dist.syncbn import SyncBatchNorm, convert_sync_batchnorm

__version__ = '0.1.0'


def is_main_process():
    """True on global rank 0, and in a job of one process: where to print and save."""
    return get_rank() == 0


__all__ = ['AgreeOnStop', 'AllReduceGradients', 'BroadcastParameters', 'CheckReplicas', 'Checkpoint',
           'DEFAULT_RENDEZVOUS_TIMEOUT', 'DEFAULT_TIMEOUT', 'DistEnv', 'EvenBatches', 'FlattenImages', 'LR_FACTOR',
           'PeerFailedError', 'PowerSGD', 'RankZeroOnly', 'RankZeroOutput', 'ReduceMetrics', 'SKIPPED_STEPS',
           'ScaleLearningRate', 'SetSamplerEpoch', 'SyncBatchNorm', 'all_gather_rows', 'convert_sync_batchnorm',
           'current_env', 'destroy_process_group', 'distributed_callbacks', 'distributed_loader',
           'gather_predictions', 'get_rank', 'get_world_size', 'init_process_group', 'is_main_process', 'launch',
           'load_checkpoint', 'process_group', 'resolve', 'save_checkpoint', 'unwatch_interrupts',
           'watch_interrupts', 'wrap_ddp', '__version__']
