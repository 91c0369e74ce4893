"""The :class:`Checkpoint` callback: a crash-safe checkpoint every few epochs, on global rank 0 only."""
import os

import torchbearer
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.checkpoint.files import save_checkpoint
from torchbearer_dist.sync import collectives


class Checkpoint(Callback):
    """Save a crash-safe checkpoint every ``every`` epochs, on global rank 0 only.

    The file is replaced atomically, so killing the job at any moment leaves the previous
    checkpoint loadable. It holds the callbacks' and learning-rate schedulers' states too. Resume
    with :func:`load_checkpoint` before ``trial.run``, on any world size: this callback then restores
    the schedulers once ``run()`` has rebuilt them, before the first epoch. At the start of training
    rank 0 checks that the directory of ``path`` exists, and every rank raises if it does not.

    Example:

        .. code-block:: python

            callbacks = [Checkpoint('run.pt'), *distributed_callbacks()]
            trial = Trial(model, optimizer, loss, callbacks=callbacks)
            if resuming:
                load_checkpoint('run.pt', trial=trial)  # every rank; only rank 0 reads the file
            trial.with_generators(train_loader).run(10)  # goes on after the last saved epoch

    Args:
        path (str): the checkpoint file, on rank 0's machine
        every (int): save after every ``every``-th epoch (counted globally, from 1)

    Raises:
        ValueError: ``every`` is not a positive integer; at the start of ``run()``, the directory of
            ``path`` does not exist on rank 0

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model to save
        - :attr:`torchbearer.state.OPTIMIZER`: the optimizer to save
        - :attr:`torchbearer.state.HISTORY`: the epochs done
        - :attr:`torchbearer.state.CALLBACK_LIST`: the callbacks whose states are saved

    .. warning:: A synchronization point at the start of each ``run()`` (the directory check).
    """

    def __init__(self, path, every=1):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError('every should be an integer >= 1, but given {!r}'.format(every))
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError('path should be a file path, but given {!r}'.format(path))
        self.path = os.fspath(path)
        self.every = every
        self.pending_schedulers = {}
        self._checked = False

    def on_start(self, state):
        self._checked = False

    def on_start_training(self, state):
        if self._checked:  # once per run(), in training only: evaluate() and predict() never save
            return
        self._checked = True
        missing = collectives.rank() == 0 and not os.path.isdir(os.path.dirname(os.path.abspath(self.path)))
        if collectives.any_rank(missing):
            raise ValueError('the directory of the checkpoint path {!r} does not exist on rank 0; create it there '
                             'first'.format(self.path))

    def on_start_epoch(self, state):
        callbacks = list(state[torchbearer.CALLBACK_LIST])
        for i, scheduler_state in sorted(self.pending_schedulers.items()):
            scheduler = _torchbearer.torch_scheduler(callbacks[i])  # see files._callback_states
            if scheduler is not None:
                scheduler.load_state_dict(scheduler_state)
        self.pending_schedulers = {}

    def on_checkpoint(self, state):
        history = state[torchbearer.HISTORY]
        if len(history) % self.every == 0:
            save_checkpoint(self.path, state[torchbearer.MODEL], state[torchbearer.OPTIMIZER], history,
                            state[torchbearer.CALLBACK_LIST])
