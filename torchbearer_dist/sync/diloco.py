"""Low-communication training, torch only: DiLoCo's outer step over a shared anchor.

Each rank trains its own copy of the model for some local steps; then :meth:`OuterStep.step` averages
the *pseudo-gradient* (the anchor, the weights every rank held after the last outer step, minus the
local weights) over all ranks, lets an outer optimizer (SGD: by default learning rate 1 without
momentum, which moves the anchor to the ranks' average; the paper's Nesterov momentum on request) step
the anchor with it, and copies the new anchor into every rank's parameters. Floating buffers
(BatchNorm statistics) are averaged at the same time, other buffers copied from rank 0. Every rank
then holds the same values, bit for bit: the all-reduce hands every rank the same sums, and the outer
step is the same arithmetic on the same numbers. The inner optimizer is not touched: its state
(momentum, Adam's moments) stays each rank's own.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023).
"""
import time

import torch

from torchbearer_dist.sync.group import WORLD
from torchbearer_dist.sync.meeting import Meeting

#: What a pseudo-gradient may travel in: None, each parameter's own dtype (an all-reduce); or an encoding of
#: :mod:`~torchbearer_dist.sync.wire`, added in fp32.
COMPRESSIONS = (None, 'fp16', 'bf16', 'int8', 'int4')
#: The outer optimizer of the DiLoCo paper (Douillard et al., 2023): a steady-state gain of 7, for an inner AdamW
#: tuned for it and hundreds of local steps. ``DiLoCo(local_steps=500, **PAPER)``.
PAPER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def gain(outer_lr, outer_momentum):
    """The outer optimizer's steady-state gain: how far the anchor moves per unit of the ranks' averaged progress.

    SGD with momentum ``m`` moves ``lr / (1 - m)`` times a gradient that stays the same from step to step
    (Nesterov's too). The default, 1, moves the anchor to the ranks' average: the progress the inner
    optimizer, tuned for synchronous training, made. The paper's 0.7 and 0.9 give 7.

    Returns:
        float: ``outer_lr / (1 - outer_momentum)``
    """
    return outer_lr / (1 - outer_momentum)


def _number(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or \
            (high is not None and value >= high):
        bound = '>= {}'.format(low) + ('' if high is None else ' and < {}'.format(high))
        raise ValueError('{} should be a number {}, but given {!r}'.format(name, bound, value))


def check_options(outer_lr, outer_momentum, nesterov, compression):
    """Raise ValueError, naming the value and the fix, for a bad outer optimizer option or wire dtype."""
    _number('outer_lr', outer_lr, 0)
    if outer_lr == 0:
        raise ValueError('outer_lr should be a number > 0, but given {!r}'.format(outer_lr))
    _number('outer_momentum', outer_momentum, 0, 1)
    if not isinstance(nesterov, bool):
        raise ValueError('nesterov should be True or False, but given {!r}'.format(nesterov))
    if compression == 'powersgd':
        raise ValueError("compression='powersgd' does not combine with local steps: PowerSGD compresses every step's "
                         "gradients, local steps send a pseudo-gradient every few steps; pass compression=None, 'fp16' "
                         "or 'bf16'")
    if compression not in COMPRESSIONS:
        raise ValueError("compression should be None, 'fp16', 'bf16', 'int8' or 'int4' (what pseudo-gradients travel "
                         "in), but given {!r}".format(compression))


def check_rounds(local_steps, overlap_steps, default_overlap, check_divergence):
    """Raise ValueError, naming the value, for a bad round option; return ``overlap_steps`` (None: the default)."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError('local_steps should be an integer >= 1, but given {!r}'.format(local_steps))
    overlap_steps = min(default_overlap, local_steps - 1) if overlap_steps is None else overlap_steps
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or not 0 <= overlap_steps < local_steps:
        raise ValueError('overlap_steps should be an integer >= 0 and below local_steps ({}), but given '
                         '{!r}'.format(local_steps, overlap_steps))
    if not isinstance(check_divergence, bool):
        raise ValueError('check_divergence should be True or False, but given {!r}'.format(check_divergence))
    return overlap_steps


def check_parameters(named_params):
    """Raise ValueError, naming the parameter, for one the outer step cannot average (not dense and real floating)."""
    for name, p in named_params:
        if p.layout != torch.strided or not p.is_floating_point():
            raise ValueError("parameter '{}' ({}, {}) cannot take local steps: only dense real floating parameters "
                             "can; freeze it (requires_grad=False) or train with AllReduceGradients".format(
                                 name, str(p.dtype).replace('torch.', ''), p.layout))


class OuterStep:
    """The anchor, the outer optimizer and the all-reduce of the pseudo-gradient: DiLoCo's outer step.

    Example:

        .. code-block:: python

            from torchbearer_dist.sync.diloco import OuterStep
            outer = OuterStep(list(model.parameters()), list(model.buffers()))
            for i, (x, y) in enumerate(loader):       # every rank its own shard
                inner.zero_grad(); loss_fn(model(x), y).backward(); inner.step()
                if (i + 1) % 50 == 0:
                    outer.step()                      # every rank now holds the same weights

    Args:
        params (list): the parameters trained locally, in the same order on every rank (floating, dense)
        buffers (list): buffers averaged (floating) or copied from rank 0 (others) at each outer step
        outer_lr (float): the outer optimizer's learning rate: 1 (the default, without momentum) moves the
            anchor to the ranks' average; the paper's is 0.7 with momentum 0.9 (:data:`PAPER`)
        outer_momentum (float): its momentum (0, the default: none; the paper's 0.9)
        nesterov (bool): Nesterov momentum (with ``outer_momentum`` > 0)
        compression (str): what pseudo-gradients travel in: None (each parameter's own dtype), ``'fp16'``,
            ``'bf16'`` (2 bytes a value), ``'int8'`` (1.03 bytes a value, block scales) or ``'int4'`` (0.56
            bytes a value), added in fp32
            (:func:`torchbearer_dist.sync.wire.mean`); the anchor, the outer step and the buffers stay in
            full precision

    .. warning:: :meth:`step` is a synchronization point: every rank must call it at the same step.
    """

    def __init__(self, params, buffers=(), outer_lr=1.0, outer_momentum=0.0, nesterov=True, compression=None):
        check_options(outer_lr, outer_momentum, nesterov, compression)
        self.params = list(params)
        self.buffers = list(buffers)
        self.compression = compression
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
            self.buffer_anchor = [b.detach().clone() for b in self.buffers]  # the buffers as of the last meeting
        self.local = None  # each rank's own parameters and buffers while show_anchor() put the anchor in their place
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0) if self.anchor else None
        self.steps = 0
        self.meeting = None  # a meeting in flight (begin() without finish())
        self.group = WORLD  # whom meetings go through (meeting.meet puts a torchft quorum's for its meeting)
        self.bytes_sent = 0  # payload handed to all-reduce and broadcast, for traffic()
        self.comm_seconds = 0.0

    def traffic(self):
        """What the outer steps' communication cost so far, as :meth:`GradientBuckets.traffic
        <torchbearer_dist.sync.buckets.GradientBuckets.traffic>` counts it.

        Returns:
            tuple: ``(bytes_sent, wait_seconds, comm_seconds)``: the payload bytes this rank handed to
            the collectives (pseudo-gradients in the wire dtype, buffers, the stop flag), and the
            seconds spent waiting for them, twice: what a meeting in flight hid is not known
        """
        return self.bytes_sent, self.comm_seconds, self.comm_seconds

    def set_buffers(self, buffers):
        """Average ``buffers`` from now on (a new run's); new ones take their values as their anchor."""
        buffers = list(buffers)
        if len(buffers) != len(self.buffers) or any(a is not b for a, b in zip(buffers, self.buffers)):
            self.buffers, self.buffer_anchor = buffers, [b.detach().clone() for b in buffers]

    def same_params(self, params):
        """Whether ``params`` are the tensors this engine was built over, in order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def reset_anchor(self):
        """Take the current parameters as the anchor (after they were copied from rank 0, or loaded)."""
        with torch.no_grad():
            for a, p in zip(self.anchor + self.buffer_anchor, self.params + self.buffers):
                a.copy_(p)

    @torch.no_grad()
    def restart(self, mid_round):
        """A new run: from the anchor if it ended between two meetings (a run that raised, a meeting dropped), else
        from the weights.

        Args:
            mid_round (bool): the last run trained steps since the last meeting, so the ranks' weights differ:
                the parameters and buffers go back to the anchor, every rank's the same
        """
        self.meeting = None  # one in flight when the last run raised
        if self.local is not None:  # the last run ended showing the anchor (after a validation): it goes on from there
            self.show_local(keep=False)
        elif mid_round:
            self.to_anchor()
            return
        self.reset_anchor()

    @torch.no_grad()
    def to_anchor(self):
        """Put the anchor into the parameters and the buffers as of the last meeting into the buffers: the round's
        local progress dropped, every rank holds the same values again."""
        for t, a in zip(self.params + self.buffers, self.anchor + self.buffer_anchor):
            t.copy_(a)

    @torch.no_grad()
    def show_anchor(self):
        """Put the anchor, the model every rank agreed on at the last meeting, in the parameters' and buffers' place.

        Each rank's own values are kept aside until :meth:`show_local`: between two meetings this is the
        one model the ranks share, for a validation pass or a checkpoint in the middle of a round.
        """
        if self.local is None:
            self.local = [t.detach().clone() for t in self.params + self.buffers]
            for t, a in zip(self.params + self.buffers, self.anchor + self.buffer_anchor):
                t.copy_(a)

    @torch.no_grad()
    def show_local(self, keep=True):
        """Put each rank's own values back after :meth:`show_anchor`; ``keep=False`` drops them (the anchor stays)."""
        local, self.local = self.local, None
        for t, own in zip(self.params + self.buffers, local if keep and local is not None else ()):
            t.copy_(own)

    @torch.no_grad()
    def step(self, stop=False):
        """Average the pseudo-gradients and buffers, step the anchor, copy it into the parameters.

        Args:
            stop (bool): this rank asks every rank to stop; the flag travels with the buffers

        Returns:
            bool: whether any rank asked to stop

        .. warning:: A synchronization point: every rank must call it.
        """
        self.begin(stop)
        return self.finish(carry=False)

    @torch.no_grad()
    def begin(self, stop=False):
        """Post a meeting's collectives (``async_op=True``) and return at once: the meeting is in flight.

        The pseudo-gradients and buffers are taken now; the parameters may go on training until
        :meth:`finish`. Call :meth:`advance` at every step in between (it moves a compressed mean to its
        second collective), at the same steps on every rank.

        .. warning:: A synchronization point: every rank must call it at the same step.
        """
        self.meeting = Meeting(self, stop)

    def advance(self):
        """Move the meeting in flight on (a compressed mean's second collective), if there is one."""
        if self.meeting is not None:
            self.meeting.advance()

    @torch.no_grad()
    def finish(self, carry=True):
        """Wait for the meeting in flight, step the anchor, and move the parameters with it.

        Args:
            carry (bool): keep the local progress made since :meth:`begin` (each parameter moves by the
                anchor's step plus what it trained since); False: every parameter becomes the anchor

        Returns:
            bool: whether any rank asked to stop in the meeting
        """
        meeting, self.meeting = self.meeting, None
        began = time.perf_counter()
        means, buffer_mean, ranks_zero = meeting.wait()
        self.comm_seconds += time.perf_counter() - began
        old = [a.clone() for a in self.anchor] if carry else None
        for (_, indices, _), mean in zip(meeting.groups, means):
            offset = 0
            for i in indices:
                n = self.anchor[i].numel()
                self.anchor[i].grad = mean[offset:offset + n].view_as(self.anchor[i])
                offset += n
        if self.outer is not None:
            self.outer.step()
            for i, (a, p) in enumerate(zip(self.anchor, self.params)):
                a.grad = None
                if carry:
                    p.add_(a - old[i] + meeting.own(i))
                else:
                    p.copy_(a)
        self.steps += 1
        if self.group.alone():  # nothing travelled: the buffers as they are now are the meeting's
            for b, anchor in zip(self.buffers, self.buffer_anchor):
                anchor.copy_(b)
            return bool(meeting.stop)
        pairs = list(zip(self.buffers, self.buffer_anchor))
        offset = 0
        for b, anchor in [(b, a) for b, a in pairs if b.is_floating_point()]:
            n = b.numel()
            mean = (buffer_mean[offset:offset + n] / self.group.size()).view_as(b)
            b.copy_(b + mean - meeting.buffers[offset:offset + n].view_as(b) if carry else mean)
            anchor.copy_(mean)
            offset += n
        for (b, anchor), (own, zero) in zip([(b, a) for b, a in pairs if not b.is_floating_point()], ranks_zero):
            b.copy_(b + zero - own if carry else zero)
            anchor.copy_(zero)
        return bool(buffer_mean[-1].item() > 0)

    def state_dict(self):
        """The anchor (with the buffers as of the last meeting), the outer optimizer's state and the outer steps."""
        return {'anchor': [a.detach().clone() for a in self.anchor],
                'buffer_anchor': [a.detach().clone() for a in self.buffer_anchor],
                'outer': self.outer.state_dict() if self.outer is not None else None, 'steps': self.steps}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned, for the same parameters.

        Raises:
            ValueError: the saved anchor does not match the parameters (another model)
        """
        anchor = state['anchor']
        if len(anchor) != len(self.anchor) or any(a.shape != b.shape for a, b in zip(anchor, self.anchor)):
            raise ValueError('the saved anchor holds {} tensors that do not match the {} parameters trained here; '
                             'resume with the model that wrote the checkpoint'.format(len(anchor), len(self.anchor)))
        with torch.no_grad():
            for a, saved in zip(self.anchor, anchor):
                a.copy_(saved)
            for a, saved in zip(self.buffer_anchor, state.get('buffer_anchor', ())):  # older checkpoints have none
                a.copy_(saved)
        if self.outer is not None and state['outer'] is not None:
            self.outer.load_state_dict(state['outer'])
        self.steps = state['steps']
