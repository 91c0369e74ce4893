"""Checkpoints that survive a crash: global rank 0 writes them atomically, and any world size resumes.

A checkpoint holds the unwrapped model's ``state_dict``, the optimizer's, the Trial's history, whose
length is the number of epochs done, and the state of the Trial's callbacks (through torchbearer's
``CallbackList.state_dict``: EarlyStopping's counters, ...) and of its learning-rate schedulers.
Parameters and optimizer state are the same on every rank, so a job resumes on any number of
processes. Only global rank 0 touches the path: it writes to a temporary file in the same directory
that is flushed, fsynced and renamed over the old one (a crash at any point leaves either the previous
checkpoint or the new one, never a torn file), and on resume it reads the file and broadcasts its
bytes, so the path need exist only on rank 0's machine. Loading always uses
``torch.load(weights_only=True)``, which refuses to run code hidden in a checkpoint.
"""
import io
import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torchbearer

from torchbearer_dist import _torchbearer
from torchbearer_dist.checkpoint._atomic import keep_previous as _keep_previous
from torchbearer_dist.checkpoint._atomic import remove_stale_temporaries as _remove_stale_temporaries
from torchbearer_dist.checkpoint._atomic import write as _write
from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.models import unwrap

#: Marks a file written by :func:`save_checkpoint`, and its layout version.
FORMAT = 'torchbearer_dist.checkpoint.files/1'


def _plain(value):
    """A history value as a type that ``weights_only`` loading accepts."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu()
    if hasattr(value, 'item'):  # numpy scalars
        return value.item()
    return str(value)


def _name(callback):
    return '{}.{}'.format(type(callback).__module__, type(callback).__qualname__)


def _is_plain(value):
    """True for what ``weights_only`` loading accepts: plain values and tensors, in lists, tuples and dicts."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in value.items())
    return False


def _callback_states(callbacks):
    """Each callback's class name, its torchbearer ``state_dict()`` and its learning-rate scheduler's state."""
    if callbacks is None:
        return []
    states = callbacks.state_dict()[torchbearer.callbacks.CallbackList.CALLBACK_STATES]
    entries = []
    for callback, state in zip(list(callbacks), states):
        if getattr(callback, 'transient', False):  # appended for a run by the package (the stop agreement's)
            continue
        # TorchScheduler saves no state of the torch scheduler it keeps privately; it is the only way to it.
        scheduler = _torchbearer.torch_scheduler(callback)
        scheduler = None if scheduler is None else scheduler.state_dict()
        for what, value in (('state', state), ('scheduler', scheduler)):
            if not _is_plain(value):
                warnings.warn('the {} of callback {} holds objects other than plain values and tensors, so it is not '
                              'saved in the checkpoint'.format(what, _name(callback)), stacklevel=3)
        entries.append({'type': _name(callback), 'state': state if _is_plain(state) else None,
                        'scheduler': scheduler if _is_plain(scheduler) else None})
    return entries


def save_checkpoint(path, model, optimizer=None, history=(), callbacks=None):
    """Save the model, the optimizer, the history and the callbacks' states to ``path``, on global rank 0 only.

    Ranks other than 0 return at once without touching ``path``, whose directory need exist only on
    rank 0's machine.

    Example: ::

        >>> import torch, tempfile, os
        >>> from torchbearer_dist.checkpoint.files import save_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), 'model.pt')
        >>> save_checkpoint(path, torch.nn.Linear(2, 1))
        True

    Args:
        path (str): the checkpoint file; its directory must exist on rank 0
        model (torch.nn.Module): the model, plain or DistributedDataParallel (saved unwrapped)
        optimizer (torch.optim.Optimizer): its optimizer, or None
        history (list): the Trial's ``state[torchbearer.HISTORY]``: one dict of metrics per epoch done
        callbacks (torchbearer.callbacks.CallbackList): the Trial's ``state[torchbearer.CALLBACK_LIST]``, whose
            states (torchbearer's ``state_dict``) and learning-rate schedulers are saved; None for none

    Returns:
        bool: True on the rank that wrote the file (global rank 0), False elsewhere

    Raises:
        ValueError: on rank 0, the directory of ``path`` does not exist
    """
    if collectives.rank() != 0:
        return False
    _write_checkpoint(path, _payload(model, optimizer, history, callbacks))
    return True


def _payload(model, optimizer, history, callbacks, position=None, rng=None):
    """What a checkpoint holds: ``position`` in a step checkpoint, ``rng`` in any the Checkpoint callback writes."""
    return {
        'format': FORMAT,
        'model': unwrap(model).state_dict(),
        'optimizer': None if optimizer is None else optimizer.state_dict(),
        'history': [{str(k): _plain(v) for k, v in entry.items()} for entry in history],
        'callbacks': _callback_states(callbacks),
        'world_size': collectives.world_size(),
        'position': position,
        'rng': rng,
    }


def _write_checkpoint(path, payload, keep=1):
    """Write ``payload`` to ``path`` atomically, keeping the ``keep - 1`` checkpoints before it as ``path.1``, ..."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError('the directory of the checkpoint path {!r} does not exist; create it first'.format(path))
    _remove_stale_temporaries(path)
    _keep_previous(path, keep)
    _write(payload, path)


def _read(path):
    """The bytes of ``path`` on every rank, read by rank 0 alone and broadcast (None where rank 0 has no file)."""
    data = None
    if collectives.rank() == 0 and os.path.isfile(path):
        with open(path, 'rb') as f:
            data = f.read()
    if collectives.world_size() == 1:
        return data
    device = collectives.comm_device(torch.device('cpu'))
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if size.item() < 0:
        return None
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data is not None else \
        torch.empty(size.item(), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, 0)
    return data if data is not None else buffer.cpu().numpy().tobytes()


def _keepers(callbacks):
    """The Trial's :class:`~torchbearer_dist.Checkpoint` callbacks, known by what they take (the callback module
    imports this one): a checkpoint loaded before ``run()`` waits in them until the run's first epoch."""
    return [c for c in (callbacks or ()) if hasattr(c, 'pending_schedulers') and hasattr(c, 'pending_position')]


def _restore_callbacks(trial, entries, position=None, rng=None):
    callbacks = [c for c in trial.state[torchbearer.CALLBACK_LIST] if not getattr(c, 'transient', False)]
    names = [_name(c) for c in callbacks]
    if names != [e['type'] for e in entries] and collectives.rank() == 0:  # other ranks silence output callbacks
        warnings.warn("the Trial's callbacks differ from those saved ({} saved, {} now); each state is restored only "
                      'where the class at its position matches'.format(len(entries), len(callbacks)), stacklevel=3)
    schedulers = {}
    for i, (callback, entry) in enumerate(zip(callbacks, entries)):
        if names[i] != entry['type']:
            continue
        if entry['state'] is not None:
            callback.load_state_dict(entry['state'])
        if entry['scheduler'] is not None:
            schedulers[i] = entry['scheduler']
    keepers = _keepers(callbacks)
    for keeper in keepers:
        keeper.pending_schedulers = schedulers
        keeper.pending_position = (position, rng) if position is not None else None
        keeper.pending_rng = rng if position is None else None  # an epoch-end checkpoint's RNG states
    if position is not None and not keepers:
        warnings.warn('the checkpoint was written in the middle of epoch {} (after {} batches), which a Checkpoint '
                      'callback in the Trial resumes; the Trial has none, so that epoch starts again from its first '
                      'batch'.format(position['epoch'] + 1, position['batches']), stacklevel=3)
    if schedulers and not keepers:
        warnings.warn('the checkpoint holds learning-rate scheduler states, which a Checkpoint callback in the Trial '
                      'restores when the schedulers are rebuilt at the start of run(); the Trial has none, so the '
                      'schedulers start afresh', stacklevel=3)


def load_checkpoint(path, model=None, optimizer=None, trial=None, map_location='cpu', missing_ok=False):
    """Load a checkpoint written by :func:`save_checkpoint` or :class:`Checkpoint`, on any world size.

    Restores the model and optimizer given, or those of ``trial``; for a Trial also its history, so
    that ``trial.run(epochs)`` goes on from the next global epoch, its callbacks' states (through
    torchbearer's ``Callback.load_state_dict``: EarlyStopping's counters, ...) and, once ``run()`` has
    rebuilt them, its learning-rate schedulers (by the Trial's :class:`Checkpoint` callback). A step
    checkpoint (``Checkpoint(every_steps=...)``, or one written at a pre-emption) also holds the
    position inside its epoch and every rank's RNG states: the Trial's :class:`Checkpoint` callback
    then goes on with the batches of that epoch not yet trained, in their order. Only global rank 0
    reads ``path``; the others receive its bytes. The world size may differ from the one that saved
    it (the rest of an interrupted epoch is then resharded over the ranks now).

    Example: ::

        >>> import torch, tempfile, os
        >>> from torchbearer_dist.checkpoint.files import load_checkpoint, save_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), 'model.pt')
        >>> _ = save_checkpoint(path, torch.nn.Linear(2, 1), history=[{'loss': 0.5}])
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 1))['history']
        [{'loss': 0.5}]

    Args:
        path (str): the checkpoint file, on rank 0's machine
        model (torch.nn.Module): a model to restore (plain or DistributedDataParallel)
        optimizer (torch.optim.Optimizer): an optimizer to restore
        trial (torchbearer.Trial): a Trial whose model, optimizer, history and callbacks are restored
        map_location: as for :func:`torch.load`; ``'cpu'`` by default
        missing_ok (bool): return None on every rank when rank 0 has no file at ``path`` (a first start),
            instead of raising

    Returns:
        dict: the checkpoint: ``'model'``, ``'optimizer'``, ``'history'``, ``'callbacks'``, ``'world_size'``,
        ``'rng'`` (each rank's RNG states, in a checkpoint of the :class:`Checkpoint` callback), and for a
        step checkpoint ``'position'`` (``epoch``, ``batches`` done per rank, ``batch_size``,
        ``world_size``); None if ``missing_ok`` and there is no file

    Raises:
        ValueError: ``path`` does not exist on rank 0 (raised on every rank)
        RuntimeError: the file is not a checkpoint of this package, or holds objects that
            ``weights_only`` loading refuses (it may carry code: never load untrusted files otherwise)

    .. warning:: A synchronization point in a job of several ranks: every rank must call it.
    """
    data = _read(path)
    if data is None and missing_ok:
        return None
    if data is None:
        raise ValueError('no checkpoint at {!r} on rank 0; pass the path given to Checkpoint or save_checkpoint'.format(
            path))
    try:
        payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RuntimeError('checkpoint {!r} holds objects other than tensors and plain values, which weights_only '
                           'loading refuses ({}); load only checkpoints written by torchbearer_dist from a source you '
                           'trust'.format(path, str(e).strip().splitlines()[0])) from None
    if not isinstance(payload, dict) or payload.get('format') != FORMAT:
        raise RuntimeError('{!r} is not a torchbearer_dist checkpoint (no format {!r}); save it with '
                           'torchbearer_dist.save_checkpoint or the Checkpoint callback'.format(path, FORMAT))
    if trial is not None:
        model = trial.state[torchbearer.MODEL] if model is None else model
        optimizer = trial.state[torchbearer.OPTIMIZER] if optimizer is None else optimizer
        trial.state[torchbearer.HISTORY] = [dict(entry) for entry in payload['history']]
        _restore_callbacks(trial, payload.get('callbacks', []), payload.get('position'), payload.get('rng'))
    if model is not None:
        unwrap(model).load_state_dict(payload['model'])
    if optimizer is not None and payload['optimizer'] is not None:
        optimizer.load_state_dict(payload['optimizer'])
    return payload
