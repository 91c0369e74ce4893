"""(private) The base class SyncBatchNorm extends: torch's ``torch.nn.modules.batchnorm._BatchNorm``.

torch offers no public base shared by BatchNorm1d/2d/3d; ``_BatchNorm`` is the one torch's own
SyncBatchNorm extends, and tools that treat BatchNorm specially recognize it. The public
alternatives are worse: a torch.nn.SyncBatchNorm subclass is refused by DDP on CPU, and a
BatchNorm2d subclass claims a dimensionality it does not check. If a torch release moves it,
:func:`base` warns once (:data:`LOST`) and falls back to BatchNorm2d. The test
``tests/sync/test_private_batchnorm.py`` fails on the pinned torch if it moved.
"""
import torch
from torch import nn

from torchbearer_dist._once import warn_once

LOST = ('torchbearer_dist: torch {} has no torch.nn.modules.batchnorm._BatchNorm; SyncBatchNorm extends BatchNorm2d '
        'instead: isinstance(layer, BatchNorm2d) is now true of every SyncBatchNorm, so tools that treat BatchNorm '
        'layers by their dimensionality (fusion, quantization) may take a 1d or 3d one for 2d')


def base():
    """The class SyncBatchNorm extends: torch's ``_BatchNorm``, or BatchNorm2d where torch moved it (warned once)."""
    found = getattr(nn.modules.batchnorm, '_BatchNorm', None)
    if found is None:
        warn_once(LOST.format(torch.__version__))
        return nn.BatchNorm2d
    return found
