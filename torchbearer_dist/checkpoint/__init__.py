"""Checkpoints that survive a crash: written atomically by global rank 0, resumable at any world size."""
from torchbearer_dist.checkpoint.callback import Checkpoint
from torchbearer_dist.checkpoint.files import FORMAT, load_checkpoint, save_checkpoint

__all__ = ['FORMAT', 'Checkpoint', 'load_checkpoint', 'save_checkpoint']
