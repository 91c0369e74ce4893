"""Checkpoints that survive a crash: global rank 0 writes them atomically, and any world size resumes.

A checkpoint holds the unwrapped model's ``state_dict``, the optimizer's, and the Trial's history,
whose length is the number of epochs done. Parameters and optimizer state are the same on every
rank, so a job resumes on any number of processes. Only global rank 0 writes, to a temporary file
in the same directory that is flushed, fsynced and renamed over the old one: a crash at any point
leaves either the previous checkpoint or the new one, never a torn file. Loading always uses
``torch.load(weights_only=True)``, which refuses to run code hidden in a checkpoint.
"""
import os
import pickle

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist import comm
from torchbearer_dist.ddp import unwrap

#: Marks a file written by :func:`save_checkpoint`, and its layout version.
FORMAT = 'torchbearer_dist.checkpoint/1'


def _plain(value):
    """A history value as a type that ``weights_only`` loading accepts."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu()
    if hasattr(value, 'item'):  # numpy scalars
        return value.item()
    return str(value)


def _remove_stale_temporaries(path):
    directory, name = os.path.split(os.path.abspath(path))
    prefix = name + '.tmp.'
    for entry in os.listdir(directory):
        pid = entry[len(prefix):]
        if entry.startswith(prefix) and pid.isdigit() and not os.path.exists('/proc/{}'.format(pid)):
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass


def _write(payload, path):
    """Write ``payload`` to ``path`` atomically: temporary file, fsync, rename, fsync of the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = '{}.tmp.{}'.format(path, os.getpid())
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def save_checkpoint(path, model, optimizer=None, history=()):
    """Save the model, the optimizer and the history to ``path``, on global rank 0 only.

    Example: ::

        >>> import torch, tempfile, os
        >>> from torchbearer_dist.checkpoint import save_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), 'model.pt')
        >>> save_checkpoint(path, torch.nn.Linear(2, 1))
        True

    Args:
        path (str): the checkpoint file; its directory must exist
        model (torch.nn.Module): the model, plain or DistributedDataParallel (saved unwrapped)
        optimizer (torch.optim.Optimizer): its optimizer, or None
        history (list): the Trial's ``state[torchbearer.HISTORY]``: one dict of metrics per epoch done

    Returns:
        bool: True on the rank that wrote the file (global rank 0), False elsewhere

    Raises:
        ValueError: the directory of ``path`` does not exist
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError('the directory of the checkpoint path {!r} does not exist; create it first'.format(path))
    if comm.rank() != 0:
        return False
    payload = {
        'format': FORMAT,
        'model': unwrap(model).state_dict(),
        'optimizer': None if optimizer is None else optimizer.state_dict(),
        'history': [{str(k): _plain(v) for k, v in entry.items()} for entry in history],
        'world_size': comm.world_size(),
    }
    _remove_stale_temporaries(path)
    _write(payload, path)
    return True


def load_checkpoint(path, model=None, optimizer=None, trial=None, map_location='cpu'):
    """Load a checkpoint written by :func:`save_checkpoint` or :class:`Checkpoint`, on any world size.

    Restores the model and optimizer given, or those of ``trial``; for a Trial also its history,
    so that ``trial.run(epochs)`` goes on from the next global epoch. Every rank loads the same
    file; the world size may differ from the one that saved it.

    Example: ::

        >>> import torch, tempfile, os
        >>> from torchbearer_dist.checkpoint import load_checkpoint, save_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), 'model.pt')
        >>> _ = save_checkpoint(path, torch.nn.Linear(2, 1), history=[{'loss': 0.5}])
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 1))['history']
        [{'loss': 0.5}]

    Args:
        path (str): the checkpoint file
        model (torch.nn.Module): a model to restore (plain or DistributedDataParallel)
        optimizer (torch.optim.Optimizer): an optimizer to restore
        trial (torchbearer.Trial): a Trial whose model, optimizer and history are restored
        map_location: as for :func:`torch.load`; ``'cpu'`` by default

    Returns:
        dict: the checkpoint: ``'model'``, ``'optimizer'``, ``'history'``, ``'world_size'``

    Raises:
        ValueError: ``path`` does not exist
        RuntimeError: the file is not a checkpoint of this package, or holds objects that
            ``weights_only`` loading refuses (it may carry code: never load untrusted files otherwise)
    """
    if not os.path.isfile(path):
        raise ValueError('no checkpoint at {!r}; pass the path given to Checkpoint or save_checkpoint'.format(path))
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
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
    if model is not None:
        unwrap(model).load_state_dict(payload['model'])
    if optimizer is not None and payload['optimizer'] is not None:
        optimizer.load_state_dict(payload['optimizer'])
    return payload


class Checkpoint(Callback):
    """Save a crash-safe checkpoint every ``every`` epochs, on global rank 0 only.

    The file is replaced atomically, so killing the job at any moment leaves the previous
    checkpoint loadable. Resume with :func:`load_checkpoint` before ``trial.run``, on any world size.

    Example:

        .. code-block:: python

            trial = Trial(model, optimizer, loss, callbacks=[Checkpoint('run.pt'), *distributed_callbacks()])
            if os.path.exists('run.pt'):
                load_checkpoint('run.pt', trial=trial)
            trial.with_generators(train_loader).run(10)  # goes on after the last saved epoch

    Args:
        path (str): the checkpoint file
        every (int): save after every ``every``-th epoch (counted globally, from 1)

    Raises:
        ValueError: ``every`` is not a positive integer

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model to save
        - :attr:`torchbearer.state.OPTIMIZER`: the optimizer to save
        - :attr:`torchbearer.state.HISTORY`: the epochs done
    """

    def __init__(self, path, every=1):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError('every should be an integer >= 1, but given {!r}'.format(every))
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError('path should be a file path, but given {!r}'.format(path))
        self.path = os.fspath(path)
        self.every = every

    def on_checkpoint(self, state):
        history = state[torchbearer.HISTORY]
        if len(history) % self.every == 0:
            save_checkpoint(self.path, state[torchbearer.MODEL], state[torchbearer.OPTIMIZER], history)
