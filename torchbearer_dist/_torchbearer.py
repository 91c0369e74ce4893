"""The one place that reads torchbearer internals.

torchbearer offers no public way to the few things below; each accessor names the internal it
reads, falls back to what still works when a torchbearer release moved it, and warns once
(``RuntimeWarning``) naming the guarantee lost. ``tests/callbacks/test_private_torchbearer.py``
fails on the pinned torchbearer if any of them moved.

- ``_Checkpointer``: the base of torchbearer's MostRecent, Best and Interval; rank-0-only output
  recognises checkpointers by it.
- ``Mean._kwargs['dim']``, ``Var._unbiased`` / ``Std._unbiased``: how a metric aggregates, which the
  global aggregators must reproduce.
- ``EpochLambda._y_pred`` / ``_y_true``: the epoch's outputs, gathered from every rank before its function runs.
- ``TorchScheduler._scheduler``: the torch scheduler a checkpoint saves and restores.
- ``CallbackListInjection.callback``: the printer or prediction collector that ``Trial.run``,
  ``evaluate`` and ``predict`` inject in front of the Trial's callbacks.
"""
from torchbearer.callbacks.torch_scheduler import TorchScheduler

from torchbearer_dist._once import warn_once

try:
    from torchbearer.callbacks.checkpointers import _Checkpointer as CHECKPOINTER
except ImportError:  # pragma: no cover - a torchbearer without it
    CHECKPOINTER = None

_LOST = 'torchbearer_dist: torchbearer {} has no {}; {}'


def _lost(internal, guarantee):
    import torchbearer
    warn_once(_LOST.format(torchbearer.__version__, internal, guarantee))


def checkpointer_types():
    """The classes of torchbearer's checkpointers, for ``isinstance``; empty when torchbearer moved them.

    Returns:
        tuple: ``(_Checkpointer,)`` or ``()``
    """
    if CHECKPOINTER is None:
        _lost('torchbearer.callbacks.checkpointers._Checkpointer',
              'ranks > 0 write checkpoints too unless each is wrapped in RankZeroOnly')
        return ()
    return (CHECKPOINTER,)


def mean_dim(node):
    """The ``dim`` a torchbearer ``Mean`` averages over (None: every element)."""
    kwargs = getattr(node, '_kwargs', None)
    if not isinstance(kwargs, dict):
        _lost('Mean._kwargs', 'a Mean over a dim is averaged over every element across ranks')
        return None
    return kwargs.get('dim')


def var_unbiased(node):
    """Whether a torchbearer ``Var`` or ``Std`` is unbiased."""
    unbiased = getattr(node, '_unbiased', None)
    if unbiased is None:
        _lost('Var._unbiased', 'Var and Std across ranks are the unbiased estimate whatever the metric asked')
        return True
    return unbiased


def gather_epoch_outputs(node, gather_rows):
    """Replace an ``EpochLambda``'s epoch outputs by ``gather_rows`` of them (every rank's, concatenated).

    Returns:
        bool: False when torchbearer moved them (warned once): the function then runs on this rank's outputs only
    """
    if not (hasattr(node, '_y_pred') and hasattr(node, '_y_true')):
        _lost('EpochLambda._y_pred / _y_true', 'an EpochLambda metric (roc_auc, ...) covers each rank\'s samples only')
        return False
    node._y_pred = gather_rows(node._y_pred)
    node._y_true = gather_rows(node._y_true)
    return True


def torch_scheduler(callback):
    """The torch scheduler a torchbearer ``TorchScheduler`` callback drives, or None."""
    if not isinstance(callback, TorchScheduler):
        return None
    if not hasattr(callback, '_scheduler'):
        _lost('TorchScheduler._scheduler', 'checkpoints neither save nor restore learning-rate schedulers')
        return None
    return callback._scheduler


def injected(callbacks):
    """The callback ``Trial.run``, ``evaluate`` or ``predict`` injected in front of ``callbacks``, or None."""
    return getattr(callbacks, 'callback', None) if hasattr(callbacks, 'callback_list') else None


def replace_injected(callbacks, callback):
    """Put ``callback`` in place of the injected one (see :func:`injected`)."""
    callbacks.callback = callback


__all__ = ['CHECKPOINTER', 'checkpointer_types', 'gather_epoch_outputs', 'injected', 'mean_dim',
           'replace_injected', 'torch_scheduler']
