"""The package's one use of a private autograd detail: running code when a backward pass ends.

torch has no public way to run code when a backward pass ends but before ``backward()`` returns.
DDP's reducer (C++), torch's Python DDP (``_DDPSink``) and FSDP all use the engine's
``queue_callback``; :class:`~torchbearer_dist.sync.buckets.GradientBuckets` does too, through
:func:`queue_at_backward_end`. If a torch release drops it, the call warns once (:data:`LOST`) and
returns False; the buckets are then reduced at the Trial's ``on_backward`` instead. The test
``tests/sync/test_private_autograd.py`` fails on the pinned torch if the detail moved.
"""
import torch

from torchbearer_dist._once import warn_once

LOST = ('torchbearer_dist: torch {} has no torch.autograd.Variable._execution_engine.queue_callback; gradients are '
        'now averaged at the Trial\'s on_backward, not before backward() returns: on_backward callbacks listed '
        'before AllReduceGradients and custom closures see this rank\'s own gradients')


def _engine_queue():
    return getattr(getattr(torch.autograd.Variable, '_execution_engine', None), 'queue_callback', None)


def queue_at_backward_end(callback):
    """Run ``callback`` when the backward pass now running ends, before ``backward()`` returns.

    Call it only from a hook that runs during backward.

    Args:
        callback (callable): takes no arguments

    Returns:
        bool: True when queued; False when this torch offers no way (warned once), so the caller runs it later
    """
    queue = _engine_queue()
    if queue is None:
        warn_once(LOST.format(torch.__version__))
        return False
    queue(callback)
    return True
