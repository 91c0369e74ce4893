"""The :class:`Checkpoint` callback: crash-safe checkpoints every few epochs or steps, and at a pre-emption."""
import os
import time

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist import _torchbearer, data
from torchbearer_dist.checkpoint import _midepoch
from torchbearer_dist.checkpoint.files import _payload, _write_checkpoint
from torchbearer_dist.runtime import interrupts
from torchbearer_dist.sync import collectives

#: State key: False on a replica of the fault-tolerant mode (:mod:`torchbearer_dist.ft`) while another live
#: replica writes the checkpoints; absent (True) otherwise. Global rank 0 alone writes in any case.
WRITER = torchbearer.state_key('torchbearer_dist_checkpoint_writer')


def _writes(state):
    return collectives.rank() == 0 and state.get(WRITER, True) is not False


def _positive(name, value, kind=int):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ValueError('{} should be a positive {}, but given {!r}'.format(
            name, 'number' if kind is float else 'integer', value))
    return value


class Checkpoint(Callback):
    """Save a crash-safe checkpoint every ``every`` epochs, and optionally every few steps, on global rank 0 only.

    The file is replaced atomically, so killing the job at any moment leaves the previous
    checkpoint loadable (in the fault-tolerant mode, on one live replica: see
    :class:`~torchbearer_dist.FaultTolerantAllReduce`). It holds the callbacks' and learning-rate
    schedulers' states too, and every
    rank's RNG states (torch, numpy, python; one gather per checkpoint). Resume with
    :func:`load_checkpoint` before ``trial.run``, on any world size: this callback then restores the
    schedulers once ``run()`` has rebuilt them, before the first epoch, and at the same world size
    each rank's RNG states, so the next epoch draws the same dropout masks, augmentations and loader
    seeds as a run never interrupted. At the start of training
    rank 0 checks that the directory of ``path`` exists, and every rank raises if it does not.

    With ``every_steps`` or ``every_seconds`` it also writes *step checkpoints* in the middle of an
    epoch, to the same ``path``: they hold, besides the above, the epoch and the number of its batches
    trained, and every rank's RNG states (torch, numpy, python; gathered on rank 0 at checkpoint time
    only). A Trial resumed from one goes on with the batches of that epoch not yet seen, in their
    order: at the same world size it ends with the same parameters, bit for bit, as a run never
    interrupted. The batches are found by their sampler's indices (none is loaded) for a DataLoader
    over a torch DistributedSampler, which also lets another world size go on with the epoch's
    remaining samples resharded; other loaders draw and drop the batches already trained.

    When :func:`~torchbearer_dist.watch_preemption` is on (in :func:`launch`'s ranks and the examples, or
    where the program calls it, as a SLURM job's should), a SIGTERM or SIGUSR1 stops every rank at the
    next step boundary, rank 0 writes a step checkpoint, and ``trial.run`` raises
    :class:`~torchbearer_dist.Preempted` (exit status 75) on every rank. This callback installs no
    signal handler itself.

    Example:

        .. code-block:: python

            keeper = Checkpoint('run.pt', every_steps=500)
            callbacks = [keeper, *distributed_callbacks()]
            trial = Trial(model, optimizer, loss, callbacks=callbacks)
            # every rank calls it; only rank 0 reads the file
            load_checkpoint('run.pt', trial=trial, missing_ok=True)
            # goes on from the last saved step
            trial.with_generators(train_loader).run(10)

    Args:
        path (str): the checkpoint file, on rank 0's machine
        every (int): save after every ``every``-th epoch (counted globally, from 1)
        every_steps (int): also save after every ``every_steps``-th training step of a run, or None
        every_seconds (float): also save at the first step after ``every_seconds`` seconds since the
            last checkpoint, by rank 0's clock, or None. Agreeing on it takes one one-element
            all-reduce per step; ``every_steps`` takes none
        keep (int): checkpoints kept: ``path`` (the newest) and ``path.1`` ... ``path.{keep-1}`` before it

    Raises:
        ValueError: ``every``, ``every_steps``, ``every_seconds`` or ``keep`` is not positive; at the
            start of ``run()``, the directory of ``path`` does not exist on rank 0
        Preempted: from ``trial.run``, after the checkpoint written for a pre-emption signal

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model to save
        - :attr:`torchbearer.state.OPTIMIZER`: the optimizer to save
        - :attr:`torchbearer.state.HISTORY`: the epochs done
        - :attr:`torchbearer.state.CALLBACK_LIST`: the callbacks whose states are saved
        - :attr:`torchbearer.state.GENERATOR`, :attr:`torchbearer.state.ITERATOR`,
          :attr:`torchbearer.state.SAMPLER`, :attr:`torchbearer.state.STEPS`: replaced for the rest of
          a resumed epoch

    .. warning:: A synchronization point at the start of each ``run()`` (the directory check), at
        each epoch end (whether any rank was pre-empted), and at each step checkpoint.
    """

    def __init__(self, path, every=1, every_steps=None, every_seconds=None, keep=1):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError('every should be an integer >= 1, but given {!r}'.format(every))
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError('path should be a file path, but given {!r}'.format(path))
        self.every_steps = _positive('every_steps', every_steps)
        self.every_seconds = _positive('every_seconds', every_seconds, float)
        self.keep = _positive('keep', keep)
        if self.keep is None:
            raise ValueError('keep should be a positive integer, but given None')
        self.path = os.fspath(path)
        self.every = every
        self.pending_schedulers = {}
        self.pending_position = None
        self.pending_rng = None
        self._checked = False
        self._training = False
        self._reset_run()

    def _reset_run(self):
        self._steps = 0  # training steps of this run
        self._done = 0  # batches of the current epoch trained, the resumed ones included
        self._epoch_rng = None
        self._resharded = False
        self._last_save = time.monotonic()

    def on_start(self, state):
        self._checked = False
        self._end_training()  # a run that raised never reached on_end
        self._reset_run()

    def on_start_training(self, state):
        if not self._checked:  # once per run(), in training only: evaluate() and predict() never save
            self._checked = True
            missing = collectives.rank() == 0 and not os.path.isdir(os.path.dirname(os.path.abspath(self.path)))
            if collectives.any_rank(missing):
                raise ValueError('the directory of the checkpoint path {!r} does not exist on rank 0; create it '
                                 'there first'.format(self.path))
        if not self._training:
            self._training = True
            interrupts.training(True)
        self._done = 0
        self._resharded = False
        pending, self.pending_position = self.pending_position, None
        if pending is None or pending[0]['epoch'] != state[torchbearer.EPOCH]:
            return
        position, rngs = pending
        mine = rngs[collectives.rank()] if rngs is not None and collectives.rank() < len(rngs) else None
        self._epoch_rng = None if mine is None else mine.get('epoch_torch')
        self._done = _midepoch.resume_epoch(state, position, self._epoch_rng)
        # The rest of an epoch resharded over another world size has no position of its own in the saved
        # order: its step checkpoints are skipped, and a fault resumes from the one just loaded.
        self._resharded = position['world_size'] != _shards(state)
        if mine is not None and not self._resharded:
            _midepoch.set_rng_state(mine)

    def on_start_epoch(self, state):
        callbacks = list(state[torchbearer.CALLBACK_LIST])
        for i, scheduler_state in sorted(self.pending_schedulers.items()):
            scheduler = _torchbearer.torch_scheduler(callbacks[i])  # see files._callback_states
            if scheduler is not None:
                scheduler.load_state_dict(scheduler_state)
        self.pending_schedulers = {}
        rngs, self.pending_rng = self.pending_rng, None
        if rngs is not None and len(rngs) == collectives.world_size():
            # An epoch-end checkpoint: the RNGs as the original run left them for this epoch.
            _midepoch.set_rng_state(rngs[collectives.rank()])
        pending = self.pending_position
        rngs = pending[1] if pending is not None and pending[0]['epoch'] == state[torchbearer.EPOCH] else None
        if rngs is not None and collectives.rank() < len(rngs) and rngs[collectives.rank()]['epoch_torch'] is not None:
            # The epoch's iterator, made next, draws its base seed from torch's RNG: as in the original run.
            torch.set_rng_state(rngs[collectives.rank()]['epoch_torch'])
        self._epoch_rng = torch.get_rng_state()

    def on_step_training(self, state):
        self._steps += 1
        self._done += 1
        if interrupts.preemption_requested() and not state[torchbearer.STOP_TRAINING]:
            state[torchbearer.STOP_TRAINING] = True  # AgreeOnStop makes every rank stop at the same step
        due = self.every_steps is not None and self._steps % self.every_steps == 0
        if not due and self.every_seconds is not None:
            late = collectives.rank() == 0 and time.monotonic() - self._last_save >= self.every_seconds
            due = collectives.any_rank(late) if collectives.world_size() > 1 else late
        if due:
            self.save_step(state)

    def on_end_training(self, state):
        preempted = interrupts.preemption_requested() is not None
        if collectives.world_size() > 1:
            preempted = collectives.any_rank(preempted)  # one small all-reduce per epoch: the signal may reach one rank
        if not preempted:
            return
        self.save_step(state)
        if collectives.world_size() > 1:
            collectives.any_rank(False)  # no rank exits (and has its launcher stop the rest) before the file is written
        self._end_training()
        if collectives.rank() == 0:
            interrupts.requeue_slurm_job()
        message = 'pre-empted by {} in epoch {} after {} batches; resumable from {}'.format(
            interrupts.preemption_requested() or 'a signal to another rank', state[torchbearer.EPOCH] + 1, self._done,
            self.path)
        interrupts.forget_preemption()
        raise interrupts.Preempted(message)

    def save_step(self, state):
        """Write a step checkpoint now: the epoch so far, every rank's RNG states, the sampler's position.

        Args:
            state (torchbearer.State): the Trial's state at a step boundary

        .. warning:: A synchronization point: every rank must call it at the same step.
        """
        if self._resharded:
            return
        _gather_for_checkpoint(state)
        rngs = _midepoch.gather_rng_states(self._epoch_rng)
        self._last_save = time.monotonic()
        if not _writes(state):
            return
        loader = state[torchbearer.GENERATOR]
        batch_sampler = getattr(loader, 'batch_sampler', None)
        position = {'epoch': state[torchbearer.EPOCH], 'batches': self._done,
                    'batch_size': getattr(batch_sampler, 'batch_size', None),
                    'world_size': _shards(state), 'steps': _steps_total(state)}
        _write_checkpoint(self.path, _payload(state[torchbearer.MODEL], state[torchbearer.OPTIMIZER],
                                              state[torchbearer.HISTORY], state[torchbearer.CALLBACK_LIST],
                                              position=position, rng=rngs), self.keep)
        self._last_save = time.monotonic()

    def on_checkpoint(self, state):
        history = state[torchbearer.HISTORY]
        if len(history) % self.every != 0:
            return
        _gather_for_checkpoint(state)  # between two DiLoCo meetings, every rank's own weights
        rngs = _midepoch.gather_rng_states(None)  # every rank: the RNGs the next epoch starts from
        if _writes(state):
            _write_checkpoint(self.path, _payload(state[torchbearer.MODEL], state[torchbearer.OPTIMIZER], history,
                                                  state[torchbearer.CALLBACK_LIST], rng=rngs), self.keep)
        self._last_save = time.monotonic()

    def _end_training(self):
        if self._training:
            self._training = False
            interrupts.training(False)

    def on_end(self, state):
        self._end_training()


def _gather_for_checkpoint(state):
    """Have every callback with state that differs per rank (DiLoCo between meetings) send it to rank 0."""
    for callback in list(state[torchbearer.CALLBACK_LIST]):
        gather = getattr(callback, 'gather_for_checkpoint', None)
        if callable(gather):
            gather(state)


def _shards(state):
    """The shards the training data is split into: its DistributedSampler's ``num_replicas`` (each replica of the
    fault-tolerant mode is a world of one, training one shard of them), else the world size."""
    sampler = data.distributed_sampler(state[torchbearer.GENERATOR])
    return getattr(sampler, 'num_replicas', None) or collectives.world_size()


def _steps_total(state):
    """The epoch's number of training steps (``state[STEPS]``, restored after the first resumed batch)."""
    return state[torchbearer.STEPS]
