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
- ``CallbackList.callback_list``: the Python list a Trial calls in order; the one list this package
  edits for a run (AgreeOnStop's and ReduceMetrics' companions go last; RankZeroOutput's stand-ins).
- ``Tqdm._loader``: the bar ``run(verbose=1)`` drew before any callback could act, erased on ranks > 0.
- ``Trial.state[GENERATOR]``: the loader of the Trial's last pass, which torchbearer leaves there;
  ``evaluate`` and ``predict`` set it before ``on_start`` and ``run`` does not, which is how the
  fault-tolerant mode tells them apart (:func:`forget_loader` clears it after every run).
"""
import torchbearer
from torchbearer.callbacks import CallbackList, Tqdm
from torchbearer.callbacks.aggregate_predictions import AggregatePredictions
from torchbearer.callbacks.torch_scheduler import TorchScheduler

from torchbearer_dist._once import warn_once

try:
    from torchbearer.callbacks.checkpointers import _Checkpointer as CHECKPOINTER
except ImportError:  # pragma: no cover - a torchbearer without it
    CHECKPOINTER = None
try:
    from torchbearer.trial import CallbackListInjection
except ImportError:  # pragma: no cover - a torchbearer without it
    CallbackListInjection = None

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
    y_pred, y_true = gather_rows(node._y_pred), gather_rows(node._y_true)  # a gather that raises changes neither
    node._y_pred, node._y_true = y_pred, y_true
    return True


def torch_scheduler(callback):
    """The torch scheduler a torchbearer ``TorchScheduler`` callback drives, or None."""
    if not isinstance(callback, TorchScheduler):
        return None
    if not hasattr(callback, '_scheduler'):
        _lost('TorchScheduler._scheduler', 'checkpoints neither save nor restore learning-rate schedulers')
        return None
    return callback._scheduler


_INJECTED_LOST = ('ranks > 0 show the progress bar a verbose= given to run, evaluate or predict asks for, and '
                  'ReduceMetrics cannot tell predict() from evaluate(): predictions are not gathered')


def injected(callbacks):
    """The callback ``Trial.run``, ``evaluate`` or ``predict`` injected in front of ``callbacks``, or None."""
    if CallbackListInjection is None:
        _lost('torchbearer.trial.CallbackListInjection', _INJECTED_LOST)
        return None
    if not isinstance(callbacks, CallbackListInjection):
        return None
    if not hasattr(callbacks, 'callback') or not isinstance(getattr(callbacks, 'callback_list', None), CallbackList):
        _lost('CallbackListInjection.callback / .callback_list', _INJECTED_LOST)
        return None
    return callbacks.callback


def injections(callbacks):
    """Every callback injected in front of ``callbacks``, outermost first (``predict``: a printer, a collector)."""
    found = []
    while injected(callbacks) is not None:
        found.append(callbacks.callback)
        callbacks = callbacks.callback_list
    return found


def predicting(callbacks):
    """True inside ``Trial.predict``, which injects an AggregatePredictions callback in front of ``callbacks``."""
    return any(isinstance(injected, AggregatePredictions) for injected in injections(callbacks))


def replace_injected(callbacks, callback):
    """Put ``callback`` in place of the injected one (see :func:`injected`)."""
    callbacks.callback = callback


_LIST_LOST = ('the Trial\'s callback list cannot be edited: AgreeOnStop\'s and ReduceMetrics\' companions do not run '
              'last (a stop asked on one rank leaves the others waiting in their next collective; a summed loss is '
              'not scaled by the number of ranks) and RankZeroOutput cannot silence printers, loggers and '
              'checkpointers on ranks > 0')


def callback_list(callbacks):
    """The Python list that a Trial's CallbackList calls in order, under any injection: the list to edit for a run.

    Args:
        callbacks (torchbearer.callbacks.CallbackList): ``state[torchbearer.CALLBACK_LIST]``

    Returns:
        list: that list itself; when torchbearer moved it (warned once), a copy, whose edits change nothing
    """
    inner = callbacks
    while isinstance(inner, CallbackList):
        inner = getattr(inner, 'callback_list', None)  # CallbackListInjection wraps the Trial's CallbackList
        if isinstance(inner, list):
            return inner
    _lost('CallbackList.callback_list', _LIST_LOST)
    return list(callbacks)


def close_bar(printer):
    """Erase and close the bar a ``Tqdm`` printer drew, if it drew one (``run(verbose=1)``'s per-epoch bar)."""
    if not isinstance(printer, Tqdm):
        return
    if not hasattr(printer, '_loader'):
        _lost('Tqdm._loader', 'on ranks > 0 the first line of run(verbose=1)\'s per-epoch bar stays on the screen')
        return
    if printer._loader is not None:
        printer._loader.leave = False
        printer._loader.close()


__all__ = ['CHECKPOINTER', 'callback_list', 'checkpointer_types', 'close_bar', 'gather_epoch_outputs', 'injected',
           'injections', 'mean_dim', 'replace_injected', 'torch_scheduler']


def forget_loader(state):
    """Clear the loader the Trial's last pass left in its ``state[GENERATOR]`` (see the module docstring).

    ``on_start`` then finds a loader there only in ``evaluate`` and ``predict``, which set one first:
    a second ``run()`` is told from them. ``state``: the run's state, whose ``SELF`` is the Trial.
    """
    trial = state.get(torchbearer.SELF)
    held = getattr(trial, 'state', None)
    if held is None or torchbearer.GENERATOR not in held:
        _lost('Trial.state[GENERATOR]', 'a second run() of a Trial in the fault-tolerant mode may not join its '
              'quorum (it stops saying so)')
        return
    held[torchbearer.GENERATOR] = None
