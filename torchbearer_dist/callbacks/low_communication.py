"""Low-communication training in a Trial: :class:`DiLoCo`, a thin callback over :mod:`torchbearer_dist.sync.diloco`."""
import weakref

import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks._stop_agreement import StopAgreement
from torchbearer_dist.sync import collectives, models
from torchbearer_dist.sync.diloco import PAPER, OuterStep, check_options, check_parameters, check_rounds, gain
from torchbearer_dist.sync.diloco_local import gather_local, restore_local
from torchbearer_dist.sync.stop_flag import StopFlag

#: Steps a meeting is in flight by default: the CNN's int4 meeting at 100 Mbit/s, 0.05 s, within 2 steps of 45 ms.
OVERLAP_STEPS = 2


class DiLoCo(Callback):
    """Train H steps locally on every rank, then average the pseudo-gradients and take an outer step.

    DiLoCo (Douillard et al., 2023) for links slower than the compute: each rank steps its own
    optimizer on its own batches for ``local_steps`` steps with no communication; then every rank
    sends the *pseudo-gradient* (the anchor, the weights all ranks held after the last outer step,
    minus its local weights) once, the average steps an outer optimizer (SGD) on the anchor, and
    every rank continues from the new anchor. One message per ``local_steps`` steps instead of one
    per step.

    **The outer optimizer's gain**, ``outer_lr / (1 - outer_momentum)``, is how far the anchor moves
    per unit of the ranks' averaged progress. The defaults have gain 1 (the anchor becomes the ranks'
    average), so a recipe tuned for synchronous training keeps its accuracy (the example's, from
    ``local_steps=8`` to 64); the paper's settings, ``**DiLoCo.PAPER`` (0.7, Nesterov 0.9), have
    gain 7, for an inner optimizer tuned for them: see :doc:`/low_communication`.

    **What it is.** Not one process at N x B: between outer steps each rank follows its own
    gradients. What is averaged at each outer step: the pseudo-gradients of every parameter the
    Trial trains (``state[MODEL]``'s and every optimizer's in the state, a GAN's discriminator
    included), and the floating buffers (BatchNorm running statistics; integer buffers are copied
    from rank 0). What stays local: the inner optimizer's state (momentum, Adam's moments) and the
    weights between outer steps. The one equivalence: ``local_steps=1``, ``outer_lr=1``,
    ``outer_momentum=0`` and plain SGD inside is gradient averaging (one process at N x B).

    After every outer step every rank holds the same weights, bit for bit, and the divergence
    sentinel compares them (one small all-reduce). The outer step runs right after
    ``state[OPTIMIZER]`` steps, before any ``on_step_training`` callback, every H steps across epoch
    ends. Between two, validation, epoch-end callbacks and checkpoints see the anchor, the model every
    rank agreed on at the last meeting (each rank's own weights return for the next pass); the run's
    last pass ends with a meeting, so the model it leaves (for predictions) holds every rank's
    progress. A run stopped after a validation (EarlyStopping) keeps the model it validated. A stop
    requested by any rank (TerminateOnNaN, a pre-emption) travels in the next stop flag, one value
    all-reduced in the background every 8 steps and read 8 steps later: every rank stops after the
    same step, at most 16 steps later whatever ``local_steps``.

    A checkpoint of :class:`~torchbearer_dist.Checkpoint` holds the anchor, the outer optimizer's
    state and, between two outer steps, every rank's local weights and inner optimizer state
    (gathered on rank 0): a run resumed from it at the same world size ends bit-identical to one
    never interrupted. At another world size every rank starts again from the anchor.

    Example: ::

        >>> from torchbearer import Trial
        >>> import torchbearer_dist as tbd
        >>> trial = Trial(model, optimizer, loss,
        ...               callbacks=[*tbd.distributed_callbacks(local_steps=50)])

    Args:
        local_steps (int): H, the optimizer steps each rank takes between two outer steps
        outer_lr (float): the outer optimizer's learning rate (1: the ranks' average; the paper's 0.7)
        outer_momentum (float): the outer optimizer's momentum (0: none; the paper's 0.9)
        nesterov (bool): Nesterov momentum in the outer optimizer (with ``outer_momentum`` > 0)
        compression (str): what pseudo-gradients travel in: ``'int4'`` (the default: 4 bits a value, an fp32
            scale per 64 values, a seventh of fp32), ``'int8'`` (a byte a value, a scale per 128), ``'bf16'``
            or ``'fp16'``, added in fp32 (:mod:`torchbearer_dist.sync.wire`); or None, the parameters' own dtype
            in an exact all-reduce. The anchor and the outer step stay in full precision
        check_divergence (bool): compare the replicas after every outer step (the divergence sentinel)
        overlap_steps (int): k > 0: a meeting lands k steps after it began, the ranks training on
            meanwhile (its wire time hidden behind k steps); the anchor then steps and each rank keeps
            its progress since (the anchors are compared, bit for bit); 0: each meeting blocks; below
            ``local_steps``; None (the default): 2, or ``local_steps - 1`` when that is less. The
            run's last meeting blocks.
        meetings (FaultTolerantAllReduce): in the fault-tolerant mode, the replica meetings go through (fp32, blocking)

    Raises:
        ValueError: a bad option (``local_steps`` < 1, an unknown ``compression``, ``'powersgd'``, ``overlap_steps``
            not in ``[0, local_steps)``, either with ``meetings``); at the start of a run, a DistributedDataParallel
            model, an optimizer without step hooks, or a parameter that is not dense real floating (named)
        RuntimeError: the divergence sentinel found a tensor that differs across ranks after an outer step

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model trained locally
        - :attr:`torchbearer.state.OPTIMIZER`: the inner optimizer; its step starts the outer step
        - any other key holding an ``nn.Module`` or an optimizer: its parameters and buffers are averaged too

    .. warning:: A synchronization point at every outer step and at the end of every training pass: every
        rank must run the same number of steps (see :class:`EvenBatches`).
    """

    PAPER = PAPER  #: The paper's outer optimizer, for ``DiLoCo(local_steps=H, **DiLoCo.PAPER)``: gain 7.

    def __init__(self, local_steps=50, outer_lr=1.0, outer_momentum=0.0, nesterov=True, compression='int4',
                 check_divergence=True, overlap_steps=None, meetings=None):
        super().__init__()
        self.overlap_steps = check_rounds(local_steps, overlap_steps, OVERLAP_STEPS, check_divergence)
        check_options(outer_lr, outer_momentum, nesterov, compression)
        if meetings is not None and (compression is not None or self.overlap_steps):
            raise ValueError('meetings through torchft block and travel in fp32: pass compression=None and '
                             'overlap_steps=0, not {!r} and {!r}'.format(compression, overlap_steps))
        self._due, self._landed = 0, None  # steps until the meeting in flight lands; what it brought (checkpoint)
        self.local_steps, self.gain = local_steps, gain(outer_lr, outer_momentum)
        self.options = dict(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                            compression=compression)
        self.check_divergence, self.meetings = check_divergence, meetings
        self.engine = None
        self._retired = (0, 0.0, 0.0)  # traffic() of the engines replaced so far
        self.inner_steps = 0  # optimizer steps since the last outer step
        self._pending = None  # a loaded state, applied once the run has its models
        self._gathered = None  # every rank's local state, on rank 0, for the step checkpoint being written
        self._hook = self._state = None
        self._fresh = self._armed = False  # _fresh: the first training pass of a run
        self._flag = StopFlag()
        self._stop_asked = self._stop_arrived = False  # this rank's request for the next flag; the flag's answer
        # Held, not inherited: this callback carries its stops; through torchft's meetings, over the live replicas
        # (a request made during a round is agreed at the pass's end: no stop flag travels at each step there).
        self._agreement = StopAgreement(self, carrier=self, group=None if meetings is None else meetings.group)

    def on_start(self, state):
        self._remove_hook()
        self._fresh = True
        if self.meetings is None and collectives.world_size() == 1:
            return
        if isinstance(state[torchbearer.MODEL], DistributedDataParallel):
            raise ValueError('the model is DistributedDataParallel, which averages gradients at every step: DiLoCo '
                             'needs a plain model; drop wrap_ddp (or distributed_callbacks(ddp=True))')
        optimizer = state.get(torchbearer.OPTIMIZER)
        if not callable(getattr(optimizer, 'register_step_post_hook', None)):
            raise ValueError('state[optimizer] ({}) has no register_step_post_hook, which DiLoCo needs to take its '
                             'outer step after the inner one; pass a torch.optim.Optimizer'.format(
                                 type(optimizer).__name__))
        check_parameters(_held.trainable(state))  # before any collective of the run

    def on_start_training(self, state):
        self._agreement.open_run(state)
        if self.meetings is None and collectives.world_size() == 1:
            return
        params = [p for _, p in _held.trainable(state)]
        fresh, self._fresh = self._fresh, False
        if self.engine is None or not self.engine.same_params(params):
            self._retired = tuple(a + b for a, b in zip(self._retired, self.engine.traffic())) \
                if self.engine is not None else self._retired
            self.engine = OuterStep(params, _held.buffers(state), **self.options)  # the anchor: rank 0's weights
            self.inner_steps = 0
        else:
            self.engine.set_buffers(_held.buffers(state))
            if fresh and self._pending is None:  # a new run of the same models
                self.engine.restart(mid_round=self.inner_steps > 0)
                self.inner_steps = 0
            self.engine.show_local()  # after the anchor showed for validation and the epoch end (if it did)
        if self._pending is not None:  # a loaded checkpoint's state
            self._load(self._pending, state[torchbearer.OPTIMIZER])
        if fresh and self.meetings is not None:  # the rest of the meeting whose quorum this replica joined at start
            self.meetings.meet(self.engine, trained=False, quorum=False)
        elif self.meetings is not None and self.inner_steps == 0:  # a round begins with this pass: replicas may join
            self.meetings.meet(self.engine, trained=False, join=True)
        if self._hook is None:
            self._state = weakref.ref(state)
            self._hook = state[torchbearer.OPTIMIZER].register_step_post_hook(self._after_inner_step)

    def traffic(self):
        """The outer steps' communication so far, for :class:`CommunicationReport`.

        Returns:
            tuple: ``(bytes_sent, wait_seconds, None)``: totals since construction (see :meth:`OuterStep.traffic
            <torchbearer_dist.sync.diloco.OuterStep.traffic>`); the seconds in flight are not known
        """
        flag = (self._flag.bytes_sent, self._flag.wait_seconds, self._flag.wait_seconds)
        engine = self.engine.traffic() if self.engine is not None else (0, 0.0, 0.0)
        sent, waited, _ = (a + b + c for a, b, c in zip(self._retired, engine, flag))
        return sent, waited, None  # how long a meeting was in flight while the ranks computed is not known

    def on_sample(self, state):
        self._stop_arrived, self._gathered = False, None
        self._armed = self.engine is not None
        if self._armed and self.meetings is None:  # rides the next stop flag (none in the fault-tolerant mode)
            self._stop_arrived = self._flag.step(self._stop_asked)
            self._stop_asked = False

    def _after_inner_step(self, optimizer, args, kwargs):
        if not self._armed:  # a step outside the Trial's training steps stays local
            return
        self._armed = False
        self.inner_steps += 1
        if self.engine.meeting is not None:
            self._due -= 1
            if self._due == 0:  # the meeting lands: the anchor steps, each rank keeps its progress since
                self.engine.finish(carry=True)
                self._check_divergence(self._state(), anchor=True)
            else:
                self.engine.advance()
        if self.inner_steps >= self.local_steps:
            if self.overlap_steps:
                self.engine.begin()  # in flight for the next overlap_steps steps
                self._due, self.inner_steps = self.overlap_steps, 0
            else:
                self._outer_step(self._state())

    def _outer_step(self, state):
        """A meeting that blocks: every rank ends with the new anchor, bit for bit."""
        if self.meetings is not None:  # through torchft's Manager; a replica behind heals at its quorum
            self.inner_steps = 0
            return self.meetings.meet(self.engine, trained=True)
        if self.engine.meeting is not None:  # land the one in flight; no step since it began: that is all
            self.engine.finish(carry=self.inner_steps > 0)
        if self.inner_steps > 0:
            self.engine.step()
        self.inner_steps = 0
        self._check_divergence(state)

    def _after_step(self, state):  # the StopCarrier of callbacks/stop.py: after every other callback of the step
        pass

    def _carried_stop(self):
        return self._stop_arrived

    def _request_stop(self):
        self._stop_asked = True

    def on_end_training(self, state):
        self._armed = False
        self._stop_arrived = self._flag.drain() or self._stop_arrived  # every flag still in flight
        if self.engine is None:
            return
        final = state[torchbearer.EPOCH] + 1 >= state[torchbearer.MAX_EPOCHS]  # alike on every rank
        asked = state[torchbearer.STOP_TRAINING] or self._stop_arrived or self._agreement.requested
        if final or self._agreement.any(asked):  # the run's last pass: one model, every rank's progress in it
            if self.inner_steps > 0 or self.engine.meeting is not None:
                self._outer_step(state)
            return
        if self.engine.meeting is not None:  # the round goes on into the next pass: land what is in flight
            self.engine.finish(carry=True)
            self._check_divergence(state, anchor=True)
        if self.inner_steps > 0:
            self.engine.show_anchor()  # validation and the epoch end see the last model every rank agreed on

    def on_end(self, state):
        self._agreement.close_run(state)
        self._remove_hook()
        if self.engine is not None and self.engine.local is not None:  # stopped after a validation (EarlyStopping)
            self.engine.show_local(keep=False)  # the model validated, the one every rank holds, is the run's
            self.inner_steps = 0

    def _remove_hook(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _check_divergence(self, state, anchor=False):
        if not self.check_divergence:
            return
        if anchor:  # a meeting that landed while the ranks trained on: their anchors agree, their weights not
            named = [('anchor of ' + name, a) for (name, _), a in zip(_held.trainable(state), self.engine.anchor)]
        differing = models.differing_tensors(named if anchor else _held.synchronised(state))
        if differing:
            raise RuntimeError("replicas diverged after outer step {} (epoch {}): '{}' differs across ranks; something "
                               "updated it on one rank only, or outside the models and optimizers trial.state holds "
                               "(store it there); DiLoCo(check_divergence=False) turns this check off".format(
                                   self.engine.steps, state.get(torchbearer.EPOCH), differing[0]))

    def gather_for_checkpoint(self, state):
        """Send every rank's local weights and inner optimizer state to rank 0, for a step checkpoint.

        Called by :class:`~torchbearer_dist.Checkpoint` on every rank just before it writes a
        checkpoint; nothing travels at an outer-step boundary, where every rank holds the anchor.

        .. warning:: A synchronization point: every rank must call it at the same step.
        """
        self._gathered = None
        if self.engine is None or collectives.world_size() == 1:
            return
        meeting, shown = self.engine.meeting, self.engine.local is not None
        if self.inner_steps > 0 or meeting is not None:
            self._landed = meeting.shared() if meeting is not None else None  # waits: the same on every rank
            self.engine.show_local()  # each rank's own values, if the anchor shows (an epoch-end checkpoint)
            self._gathered = gather_local(self.engine, state[torchbearer.OPTIMIZER],
                                          meeting.local() if meeting is not None else ())
            if shown:
                self.engine.show_anchor()

    def state_dict(self):
        if self.engine is None:
            return self._pending
        meeting = None if self.engine.meeting is None or self._gathered is None else \
            {'due': self._due, 'shared': self._landed}
        return {'inner_steps': self.inner_steps, 'engine': self.engine.state_dict(), 'local': self._gathered,
                'meeting': meeting}

    def _load(self, saved, optimizer):
        self.engine.load_state_dict(saved['engine'])
        self.inner_steps, self._due = restore_local(self.engine, saved, optimizer)
        self._pending = None

    def load_state_dict(self, state_dict):
        self._pending = state_dict  # applied in on_start_training, after rank 0's weights are everywhere
        if self.meetings is not None and self.engine is not None and state_dict is not None:
            self._load(state_dict, None)  # a heal at a meeting's quorum: the healer's anchor, now
