"""Rank 0's weights on every rank before the first step: every model and optimizer parameter the Trial holds."""
import weakref

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks.gradients import SKIPPED_STEPS, AllReduceGradients  # noqa: F401 (re-exported)
from torchbearer_dist.sync import collectives, models


class BroadcastParameters(Callback):
    """Copy rank 0's parameters and buffers to every rank before the first epoch of a Trial.

    It copies every ``nn.Module`` the Trial's state holds, under any key (``state[MODEL]``, and a GAN's
    discriminator kept under a key of the program's own), and every parameter of an optimizer in the
    state that no such module holds. It acts at the start of the first epoch that a Trial runs,
    evaluates or predicts, after every callback's ``on_init`` and ``on_start`` (weight
    initialisation, a loaded checkpoint), and also when the process group came up after the Trial
    was built. It first checks, with one small exchange of a fingerprint, that every rank holds the
    same parameter and buffer names, shapes and dtypes; on a mismatch every rank raises, naming the
    first entry that differs (``state[key].name`` for a module outside ``state[MODEL]``). Values are
    copied, never averaged. A new Trial, or a new model in the Trial, is broadcast again.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import BroadcastParameters
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[BroadcastParameters()])

    Args:
        method (str): ``'broadcast'`` (one collective per dtype) or ``'p2p'`` (``send`` from rank 0
            and ``recv`` on the others, as in the PyTorch tutorial)
        src (int): the rank whose values every rank takes

    Raises:
        ValueError: an unknown ``method``

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model to synchronize
        - any other key holding an ``nn.Module`` or an optimizer: synchronized too
        - :attr:`torchbearer.state.SELF`: the Trial, to broadcast once per Trial and set of models

    .. warning:: A synchronization point: every rank must run its Trial.
    """

    def __init__(self, method='broadcast', src=0):
        super().__init__()
        if method not in ('broadcast', 'p2p'):
            raise ValueError("method should be 'broadcast' or 'p2p', but given {!r}".format(method))
        self.method = method
        self.src = src
        self._done = None  # weak references to the Trial and the models last broadcast

    def on_start_epoch(self, state):
        if collectives.world_size() == 1:
            return
        modules = [module for _, module in _held.held_modules(state)]
        if not modules and not _held.held_optimizers(state):
            return
        trial = state.get(torchbearer.SELF)
        if self._done is not None and self._done[0]() is trial and [r() for r in self._done[1]] == modules:
            return
        entries = _held.synchronised(state)
        model = state.get(torchbearer.MODEL)
        device = models.module_device(model) if isinstance(model, torch.nn.Module) else None
        models.check_same_tensors(entries, self.src, collectives.comm_device(device) if device is not None else None)
        models.broadcast_tensors([t for _, t in entries], self.src, self.method)
        self._done = (weakref.ref(trial) if trial is not None else lambda: None, [weakref.ref(m) for m in modules])
