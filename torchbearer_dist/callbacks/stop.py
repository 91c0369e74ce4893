"""Stopping together: a stop requested by any callback on any rank ends every rank at the same step."""
import weakref

import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import collectives


class _LastWord(Callback):
    """Runs after every other callback of the Trial's list, where a stop request of this step is final."""

    def __init__(self, owner):
        super().__init__()
        self.owner = weakref.proxy(owner)

    def on_step_training(self, state):
        self.owner._after_step(state)

    def on_end_training(self, state):
        self.owner._agree_on_stop(state, self.owner._stop_requested)

    def on_checkpoint(self, state):
        self.owner._agree_on_stop(state, state[torchbearer.STOP_TRAINING])

    def __str__(self):
        owner = self.owner.gradients if self.owner.gradients is not None else self.owner
        return 'stop agreement of {}'.format(owner.__class__.__name__)


def _callback_list(state):
    """The Python list of callbacks that the Trial's own CallbackList iterates (under any injection)."""
    return _torchbearer.callback_list(state[torchbearer.CALLBACK_LIST])


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
        self._stop_requested = False
        self._stop_agreed = False
        self._last_word = _LastWord(self)
        self._run_state = None
        #: The AllReduceGradients that holds this agreement (its buckets carry the request), or None.
        self.gradients = None
        self._owned = False  # held by an AllReduceGradients of the user's list
        self._companion = None  # on a DDP model: the AllReduceGradients this agreement runs for the rest
        self._beside = None  # the companion, for the runs whose model is DDP

    def on_start(self, state):
        self._beside = None
        if self._owned:
            return
        if collectives.world_size() > 1 and isinstance(state.get(torchbearer.MODEL), DistributedDataParallel):
            if self._companion is None:
                from torchbearer_dist.callbacks.gradients import AllReduceGradients  # it imports this module
                self._companion = AllReduceGradients._beside_ddp(self)
            self.gradients = weakref.proxy(self._companion)
            self._beside = self._companion
            self._beside.on_start(state)
        else:
            self.gradients = None

    @property
    def buckets(self):
        """The gradient buckets that carry a stop request with the step's gradients, or None."""
        return None if self.gradients is None else self.gradients.buckets

    def on_start_training(self, state):
        if self._beside is not None:
            self._beside.on_start_training(state)  # which opens the run here
        else:
            self._open_run(state)

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
            self._close_run(state)

    def _open_run(self, state):
        self._stop_requested = self._stop_agreed = False
        if collectives.world_size() == 1:
            return
        # torchbearer calls callbacks in list order and has no hook after them all: the one place where
        # this package edits the Trial's callback list, for the run (removed in on_end, and before it is
        # appended again, so a run that raised leaves no duplicate).
        callbacks = _callback_list(state)
        if self._last_word in callbacks:
            callbacks.remove(self._last_word)
        callbacks.append(self._last_word)
        self._run_state = weakref.ref(state)

    def _close_run(self, state):
        if self._run_state is not None and self._run_state() is state:  # not an evaluate() nested in the run
            callbacks = _callback_list(state)
            if self._last_word in callbacks:
                callbacks.remove(self._last_word)

    def _stopped_by_buckets(self):
        """Whether the gradients of this step carried a stop request from some rank."""
        buckets = self.buckets
        return buckets is not None and buckets.synced and buckets.stop

    def _after_step(self, state):
        if self.gradients is not None:
            self.gradients._after_step(state)  # the step's last checks, after every other callback
        if self._stopped_by_buckets():
            self._stop_requested, self._stop_agreed = False, True
            state[torchbearer.STOP_TRAINING] = True
            return
        if state[torchbearer.STOP_TRAINING] and not self._stop_agreed:
            # Hold the stop until every rank knows: it travels with the next step's gradients.
            state[torchbearer.STOP_TRAINING] = False
            self._stop_requested = True
            if self.buckets is not None:
                self.buckets.request_stop()
        if self.buckets is None:
            # One all-reduce carries the stop requests and, with it, whether a rank's trainable set changed.
            word = getattr(self.gradients, '_change_word', None)  # an engine that follows the trainable set
            change = word is not None and word(state)
            base = collectives.world_size() + 1
            total = collectives.reduce_int(int(self._stop_requested) + base * int(change), 'sum')
            if total >= base:
                self.gradients._follow(state, during_backward=False)
            if total % base:
                self._stop_requested = False
                state[torchbearer.STOP_TRAINING] = True

    def _agree_on_stop(self, state, flag):
        if collectives.any_rank(flag or state[torchbearer.STOP_TRAINING]):
            state[torchbearer.STOP_TRAINING] = True
        self._stop_requested = self._stop_agreed = False
