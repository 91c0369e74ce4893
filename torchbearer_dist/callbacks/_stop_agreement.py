"""How a stop requested on one rank ends every rank after the same step: the mechanism each stop agreement runs.

:class:`~torchbearer_dist.AgreeOnStop`, :class:`~torchbearer_dist.AllReduceGradients` and
:class:`~torchbearer_dist.DiLoCo` each hold a :class:`StopAgreement`. Its carrier, the callback whose own
collectives take the stop request along (the protocol is :class:`~torchbearer_dist.callbacks.stop.StopCarrier`),
is an AllReduceGradients (its gradient buckets) or a DiLoCo (its stop flag); without one, the agreement
all-reduces one integer of its own at each step.
"""
import weakref

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.group import SUM

#: Over a group (the fault-tolerant mode's), the one all-reduce of a step carries each member's stop request (0
#: or 1) plus this times whether its trainable set changed: more than any count of members.
_BASE = 1 << 20


class _LastWord(Callback):
    """Runs after every other callback of the Trial's list, where a stop request of this step is final."""

    #: Appended to the Trial's list for a run by the package: no state of its own, left out of checkpoints and
    #: heals (whose callback states go by position: a Trial between runs holds no such companion).
    transient = True

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

    In the fault-tolerant mode the agreement is over the live replicas (``group``), whose members change from step
    to step: a request counts once an exchange that held every member's word carried it (a step torchft
    committed, or an all-reduce that torchft did not fail); until then it is held and sent again with the next
    step, so that every replica stops after the same step, never one alone.

    Args:
        holder (object): the callback that holds it, named in the companion's ``str``
        carrier (StopCarrier): the callback whose collectives carry the stop requests (held weakly), or
            None; a holder may set :attr:`carrier` for each run
        group (callable): None: the default process group; else it returns the group to agree over now (the
            interface of :mod:`torchbearer_dist.sync.group`), or None where this rank talks to nobody now
    """

    def __init__(self, holder, carrier=None, group=None):
        self.holder = type(holder).__name__
        self.carrier = None if carrier is None else weakref.proxy(carrier)
        self.group = group
        self.requested = False  # this rank asked to stop and awaits every rank's word
        self.agreed = False
        self._last_word = _LastWord(self)
        self._run_state = None

    def _sum(self, value):
        """``(the sum of value over the members, whether every member's word is in it)``."""
        if self.group is None:
            return collectives.reduce_int(value, 'sum'), True
        group = self.group()
        if group is None:
            return int(value), True  # nobody to tell: this rank's own word decides for itself
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=group.device())
        whole = group.all_reduce(tensor, SUM).wait()
        return (int(round(tensor.item())), True) if whole else (int(value), False)

    def any(self, flag):
        """Whether ``flag`` is set on any member, by one all-reduce; where an exchange of the fault-tolerant mode
        failed (a replica lost meanwhile), False, and this rank's own ``flag`` is held as a stop request, sent again
        with the next step.

        .. warning:: A synchronization point: every member must call it at the same point.
        """
        if self.group is None:
            return collectives.any_rank(flag)
        total, whole = self._sum(1 if flag else 0)
        if not whole:
            self.requested = self.requested or bool(flag)
            return False
        return total > 0

    def open_run(self, state):
        self.requested = self.agreed = False
        if self.group is None and collectives.world_size() == 1:
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
        if self.group is not None and self.group() is None:
            return  # nobody to tell (a replica's run that ends to begin again at its healer's position): it stands
        carried = None if carrier is None else carrier._carried_stop()
        if carried:
            self.requested, self.agreed = False, True
            state[torchbearer.STOP_TRAINING] = True
            return
        if state[torchbearer.STOP_TRAINING] and not self.agreed:
            # Hold the stop until every rank knows: it travels with the carrier's next collectives.
            state[torchbearer.STOP_TRAINING] = False
            self.requested = True
        if self.requested and carried is not None:  # again after a step whose exchange did not carry it
            carrier._request_stop()
        if carried is None:
            # One all-reduce carries the stop requests and, with it, whether a rank's trainable set changed.
            change = carrier is not None and carrier._change_word(state)
            base = (collectives.world_size() if self.group is None else _BASE) + 1
            total, whole = self._sum(int(self.requested) + base * int(change))
            if total >= base:
                carrier._follow(state, during_backward=False)
            if whole and total % base:
                self.requested = False
                state[torchbearer.STOP_TRAINING] = True

    def agree(self, state, flag):
        """One all-reduce: every rank stops if ``flag`` or ``STOP_TRAINING`` is set on any rank.

        .. warning:: A synchronization point: every rank must call it at the same point.
        """
        wanted = flag or state[torchbearer.STOP_TRAINING]
        self.requested = self.agreed = False
        if self.any(wanted):
            state[torchbearer.STOP_TRAINING] = True
        elif self.requested:  # the fault-tolerant mode's exchange failed: the request goes with the next step
            state[torchbearer.STOP_TRAINING] = False
