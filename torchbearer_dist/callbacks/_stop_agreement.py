"""How a stop requested on one rank ends every rank after the same step: the mechanism each stop agreement runs.

:class:`~torchbearer_dist.AgreeOnStop`, :class:`~torchbearer_dist.AllReduceGradients` and
:class:`~torchbearer_dist.DiLoCo` each hold a :class:`StopAgreement`. Its carrier, the callback whose own
collectives take the stop request along (the protocol is :class:`~torchbearer_dist.callbacks.stop.StopCarrier`),
is an AllReduceGradients (its gradient buckets) or a DiLoCo (its stop flag); without one, the agreement
all-reduces one integer of its own at each step.
"""
import weakref

import torchbearer
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import collectives


class _LastWord(Callback):
    """Runs after every other callback of the Trial's list, where a stop request of this step is final."""

    def __init__(self, agreement):
        super().__init__()
        self.agreement = weakref.proxy(agreement)

    def on_step_training(self, state):
        self.agreement.after_step(state)

    def on_end_training(self, state):
        self.agreement.agree(state, self.agreement.requested)

    def on_checkpoint(self, state):
        self.agreement.agree(state, state[torchbearer.STOP_TRAINING])

    def __str__(self):
        carrier = self.agreement.carrier
        return 'stop agreement of {}'.format(self.agreement.holder if carrier is None else carrier.__class__.__name__)


def callback_list(state):
    """The Python list of callbacks that the Trial's own CallbackList iterates (under any injection)."""
    return _torchbearer.callback_list(state[torchbearer.CALLBACK_LIST])


class StopAgreement:
    """A stop set by any callback on any rank (``state[STOP_TRAINING]``) ends every rank after the same step.

    Its holder opens it at each training run start (:meth:`open_run`) and closes it at the run end
    (:meth:`close_run`); for the run, a small companion is appended to the end of the Trial's callback
    list, which reads the step's stop requests after every other callback has run (torchbearer has no
    hook after them all). A stop set during a step is held back until every rank knows: it travels
    with the carrier's next collectives, or, where those carry nothing this step, in one all-reduce
    at this step. A stop set at the end of a training pass or at a checkpoint is agreed by one all-reduce.

    Args:
        holder (object): the callback that holds it, named in the companion's ``str``
        carrier (StopCarrier): the callback whose collectives carry the stop requests (held weakly), or
            None; a holder may set :attr:`carrier` for each run
    """

    def __init__(self, holder, carrier=None):
        self.holder = type(holder).__name__
        self.carrier = None if carrier is None else weakref.proxy(carrier)
        self.requested = False  # this rank asked to stop and awaits every rank's word
        self.agreed = False
        self._last_word = _LastWord(self)
        self._run_state = None

    def open_run(self, state):
        self.requested = self.agreed = False
        if collectives.world_size() == 1:
            return
        # torchbearer calls callbacks in list order and has no hook after them all: the one place where
        # this package edits the Trial's callback list, for the run (removed in close_run, and before it is
        # appended again, so a run that raised leaves no duplicate).
        callbacks = callback_list(state)
        if self._last_word in callbacks:
            callbacks.remove(self._last_word)
        callbacks.append(self._last_word)
        self._run_state = weakref.ref(state)

    def close_run(self, state):
        if self._run_state is not None and self._run_state() is state:  # not an evaluate() nested in the run
            callbacks = callback_list(state)
            if self._last_word in callbacks:
                callbacks.remove(self._last_word)

    def after_step(self, state):
        carrier = self.carrier
        if carrier is not None:
            carrier._after_step(state)  # the step's last checks, after every other callback
        carried = None if carrier is None else carrier._carried_stop()
        if carried:
            self.requested, self.agreed = False, True
            state[torchbearer.STOP_TRAINING] = True
            return
        if state[torchbearer.STOP_TRAINING] and not self.agreed:
            # Hold the stop until every rank knows: it travels with the carrier's next collectives.
            state[torchbearer.STOP_TRAINING] = False
            self.requested = True
            if carried is not None:
                carrier._request_stop()
        if carried is None:
            # One all-reduce carries the stop requests and, with it, whether a rank's trainable set changed.
            change = carrier is not None and carrier._change_word(state)
            base = collectives.world_size() + 1
            total = collectives.reduce_int(int(self.requested) + base * int(change), 'sum')
            if total >= base:
                carrier._follow(state, during_backward=False)
            if total % base:
                self.requested = False
                state[torchbearer.STOP_TRAINING] = True

    def agree(self, state, flag):
        """One all-reduce: every rank stops if ``flag`` or ``STOP_TRAINING`` is set on any rank.

        .. warning:: A synchronization point: every rank must call it at the same point.
        """
        if collectives.any_rank(flag or state[torchbearer.STOP_TRAINING]):
            state[torchbearer.STOP_TRAINING] = True
        self.requested = self.agreed = False
