"""The fault-tolerant mode, on torchft: training that goes on when a machine is lost.

Each process is a torchft replica group; a lighthouse forms the quorum of live replicas at every step (or
DiLoCo meeting). :class:`FaultTolerantAllReduce` averages a Trial's gradients over them and heals a (re)started
replica from a healthy one; ``distributed_callbacks(fault_tolerant='HOST:PORT')`` gives the set. torchft is an
optional extra: importing this package works without it, using it says how to install it.
"""
from torchbearer_dist.checkpoint.callback import WRITER
from torchbearer_dist.ft.callback import FaultTolerantAllReduce
from torchbearer_dist.ft.lighthouse import Lighthouse
from torchbearer_dist.ft.replica import INSTALL, require_torchft

__all__ = ['INSTALL', 'WRITER', 'FaultTolerantAllReduce', 'Lighthouse', 'require_torchft']
