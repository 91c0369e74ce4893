"""Stopping together: a stop requested by any callback on any rank ends every rank at the same step.

A stop request travels with the collectives a callback runs anyway, where one runs at every step: the
callback is then a :class:`StopCarrier`. The mechanism, held by every carrier and by :class:`AgreeOnStop`,
is :class:`~torchbearer_dist.callbacks._stop_agreement.StopAgreement`.
"""
import weakref
from typing import Protocol, runtime_checkable

import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist.callbacks._stop_agreement import StopAgreement
from torchbearer_dist.callbacks.gradients import AllReduceGradients
from torchbearer_dist.sync import collectives


@runtime_checkable
class StopCarrier(Protocol):
    """What a callback offers so that a stop request travels with its own collectives, at no extra one.

    :class:`~torchbearer_dist.AllReduceGradients` carries a request in the stop flag of its last gradient
    bucket, :class:`~torchbearer_dist.DiLoCo` in a one-value all-reduce per step (posted at ``on_sample``,
    read after the step); either way every rank stops after the next step. A carrier holds a
    ``StopAgreement(self, carrier=self)``, opens it at each training run start and closes it at the run
    end, and offers these three methods, which the agreement calls after every other callback of a step.
    """

    def _after_step(self, state):
        """The step's last work, before its stop requests are read (the carrier's collectives end here)."""

    def _carried_stop(self):
        """Whether this step's collectives brought a stop request from some rank (alike on every rank).

        None where none of its collectives can carry one now: the agreement then all-reduces one integer
        of its own at this step, which also carries the carrier's ``_change_word(state)`` (whether this
        rank's trainable set changed) and, when any rank's word is set, calls its
        ``_follow(state, during_backward=False)``: only AllReduceGradients, without buckets, does so.
        """

    def _request_stop(self):
        """Send this rank's stop request with the next step's collectives (called where ``_carried_stop()``
        was not None in this step)."""


class AgreeOnStop(Callback):
    """Make every rank stop at the same step when a callback on any rank stops training.

    A callback such as TerminateOnNaN sees only its own rank's loss; if it stopped that rank alone,
    the others would wait for it in their next collective. Used alone (with a DistributedDataParallel
    model), it agrees on a stop set in ``on_step_training`` with one small all-reduce per step, and
    every rank stops after that step. :class:`AllReduceGradients` does this itself at no cost: the
    request rides in the next step's gradient buckets, and every rank stops after that next step. A
    stop set at the end of an epoch is agreed by one all-reduce.

    On a DistributedDataParallel model (the DDP path of :func:`distributed_callbacks`), DDP averages
    only the model it wraps: AgreeOnStop then runs an :class:`AllReduceGradients` for everything else
    the Trial holds (a GAN's discriminator and its optimizer, under any state key), whose buckets
    carry the stop requests, and the divergence sentinel with it.

    It works wherever it sits in the callback list: for the length of each training run it appends a
    small companion to the end of the Trial's callback list, which reads the stop requests of the step
    after every other callback has run (torchbearer has no hook that runs after all callbacks).

    Example: ::

        >>> from torchbearer.callbacks import TerminateOnNaN
        >>> from torchbearer_dist import AgreeOnStop
        >>> model = torch.nn.Linear(2, 1)
        >>> trial = Trial(model, callbacks=[AgreeOnStop(), TerminateOnNaN()])

    State Requirements:
        - :attr:`torchbearer.state.STOP_TRAINING`: read and set
        - :attr:`torchbearer.state.CALLBACK_LIST`: its companion is appended for the run

    .. warning:: A synchronization point at each step (without gradient buckets) and each epoch end.
    """

    def __init__(self):
        super().__init__()
        self._agreement = StopAgreement(self)
        #: The AllReduceGradients whose buckets carry the stop requests (on a DDP model), or None.
        self.gradients = None
        self._companion = None  # on a DDP model: the AllReduceGradients this agreement runs for the rest
        self._beside = None  # the companion, for the runs whose model is DDP

    def on_start(self, state):
        self._beside = None
        if collectives.world_size() > 1 and isinstance(state.get(torchbearer.MODEL), DistributedDataParallel):
            if self._companion is None:
                self._companion = AllReduceGradients._beside_ddp(self._agreement)
            self.gradients = weakref.proxy(self._companion)
            self._beside = self._companion
            self._beside.on_start(state)
        else:
            self.gradients = None
        self._agreement.carrier = self.gradients

    @property
    def buckets(self):
        """The gradient buckets that carry a stop request with the step's gradients, or None."""
        return None if self.gradients is None else self.gradients.buckets

    def on_start_training(self, state):
        if self._beside is not None:
            self._beside.on_start_training(state)  # which opens the run here
        else:
            self._agreement.open_run(state)

    def on_sample(self, state):
        if self._beside is not None:
            self._beside.on_sample(state)

    def on_backward(self, state):
        if self._beside is not None:
            self._beside.on_backward(state)

    def on_end_training(self, state):
        if self._beside is not None:
            self._beside.on_end_training(state)

    def on_end(self, state):
        if self._beside is not None:
            self._beside.on_end(state)  # which closes the run here
        else:
            self._agreement.close_run(state)
