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
import copy
import time
import zlib

import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives, wire

#: What a pseudo-gradient may travel in: None, each parameter's own dtype (an all-reduce); or an encoding of
#: :mod:`~torchbearer_dist.sync.wire`, added in fp32.
COMPRESSIONS = (None, 'fp16', 'bf16', 'int8')
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
        raise ValueError("compression should be None, 'fp16', 'bf16' or 'int8' (what pseudo-gradients travel in), "
                         "but given {!r}".format(compression))


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
            ``'bf16'`` (2 bytes a value) or ``'int8'`` (1.03 bytes a value, block scales), added in fp32
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
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0) if self.anchor else None
        self.steps = 0
        self.bytes_sent = 0  # payload handed to all-reduce and broadcast, for traffic()
        self.comm_seconds = 0.0

    def traffic(self):
        """What the outer steps' communication cost so far, as :meth:`GradientBuckets.traffic
        <torchbearer_dist.sync.buckets.GradientBuckets.traffic>` counts it.

        Returns:
            tuple: ``(bytes_sent, wait_seconds, comm_seconds)``: the payload bytes this rank handed to
            all-reduce and broadcast (pseudo-gradients in the wire dtype, buffers, the stop flag), and
            the seconds spent in them, twice: an outer step's collectives are synchronous, nothing
            hides them
        """
        return self.bytes_sent, self.comm_seconds, self.comm_seconds

    def _all_reduce(self, tensor):
        began = time.perf_counter()
        dist.all_reduce(tensor)
        self.comm_seconds += time.perf_counter() - began
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def same_params(self, params):
        """Whether ``params`` are the tensors this engine was built over, in order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def reset_anchor(self):
        """Take the current parameters as the anchor (after they were copied from rank 0, or loaded)."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p)

    @torch.no_grad()
    def step(self, stop=False):
        """Average the pseudo-gradients and buffers, step the anchor, copy it into the parameters.

        Args:
            stop (bool): this rank asks every rank to stop; the flag travels with the buffers

        Returns:
            bool: whether any rank asked to stop

        .. warning:: A synchronization point: every rank must call it.
        """
        world = collectives.world_size()
        groups = {}
        for i, p in enumerate(self.params):
            groups.setdefault(p.dtype, []).append(i)
        for dtype in sorted(groups, key=str):  # the same order on every rank
            indices = groups[dtype]
            flat = torch.cat([(self.anchor[i] - self.params[i]).reshape(-1) for i in indices])
            if world > 1 and self.compression is None:
                flat.div_(world)
                self._all_reduce(flat)
            elif world > 1:
                began = time.perf_counter()
                flat = wire.mean(flat.to(torch.float32), self.compression).to(dtype)
                self.comm_seconds += time.perf_counter() - began
                self.bytes_sent += wire.wire_bytes(flat.numel(), world, self.compression)
            offset = 0
            for i in indices:
                n = self.anchor[i].numel()
                self.anchor[i].grad = flat[offset:offset + n].view_as(self.anchor[i])
                offset += n
        if self.outer is not None:
            self.outer.step()
            for a, p in zip(self.anchor, self.params):
                a.grad = None
                p.copy_(a)
        self.steps += 1
        return self._average_buffers(stop) if world > 1 else bool(stop)

    def _average_buffers(self, stop):
        floating = [b for b in self.buffers if b.is_floating_point()]
        device = floating[0].device if floating else (self.params[0].device if self.params else torch.device('cpu'))
        flat = torch.cat([b.reshape(-1).to(torch.float64) for b in floating] +
                         [torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device=device)])
        self._all_reduce(flat)
        offset = 0
        for b in floating:
            n = b.numel()
            b.copy_((flat[offset:offset + n] / collectives.world_size()).view_as(b))
            offset += n
        others = [b for b in self.buffers if not b.is_floating_point()]
        began = time.perf_counter()
        for b in others:
            dist.broadcast(b, 0)
            self.bytes_sent += b.numel() * b.element_size()
        self.comm_seconds += time.perf_counter() - began
        return bool(flat[-1].item() > 0)

    def state_dict(self):
        """The anchor, the outer optimizer's state and the number of outer steps: plain values and tensors."""
        return {'anchor': [a.detach().clone() for a in self.anchor],
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
        if self.outer is not None and state['outer'] is not None:
            self.outer.load_state_dict(state['outer'])
        self.steps = state['steps']


def _tensor_leaves(optimizer_state):
    """The tensors of an optimizer's ``state_dict()['state']``, in a fixed order (parameter index, then name)."""
    leaves = []
    for index in sorted(optimizer_state['state']):
        entry = optimizer_state['state'][index]
        leaves.extend(entry[name] for name in sorted(entry) if isinstance(entry[name], torch.Tensor))
    return leaves


def _with_leaves(optimizer_state, tensors):
    """A copy of ``optimizer_state`` whose tensors, in :func:`_tensor_leaves`' order, are ``tensors``."""
    tensors = iter(tensors)
    state = {index: {name: next(tensors) if isinstance(value, torch.Tensor) else value
                     for name, value in sorted(entry.items())}
             for index, entry in sorted(optimizer_state['state'].items())}
    return {'state': state, 'param_groups': copy.deepcopy(optimizer_state['param_groups'])}


def gather_local(engine, optimizer):
    """Every rank's local weights, buffers and inner optimizer state, on rank 0, each tensor in its own dtype.

    One fixed-shape ``gather`` per dtype (no pickling), after one all-reduce that checks every rank
    holds the same shapes and dtypes; the bytes and seconds count in ``engine.traffic()``.

    Args:
        engine (OuterStep): its ``params`` and ``buffers`` are gathered
        optimizer (torch.optim.Optimizer): the inner optimizer, whose ``state_dict()`` is gathered

    Returns:
        list: on rank 0, per rank ``{'params', 'buffers', 'optimizer'}``; None on the other ranks

    Raises:
        RuntimeError: the inner optimizer holds state of different shapes on different ranks

    .. warning:: A synchronization point: every rank must call it at the same step.
    """
    began = time.perf_counter()
    state = copy.deepcopy(optimizer.state_dict())
    leaves = [t.detach() for t in list(engine.params) + list(engine.buffers) + _tensor_leaves(state)]
    device = collectives.comm_device(leaves[0].device if leaves else torch.device('cpu'))  # gloo: CPU only
    signature = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t in leaves]).encode())
    seen = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen[0] != -seen[1]:
        raise RuntimeError('the inner optimizer holds state of different shapes on different ranks, so a step '
                           'checkpoint cannot hold it; give every parameter a gradient on every rank')
    world, mine = collectives.world_size(), collectives.rank() == 0
    values = [[None] * len(leaves) for _ in range(world)]
    by_dtype = {}
    for i, t in enumerate(leaves):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        indices = by_dtype[dtype]
        flat = torch.cat([leaves[i].reshape(-1).to(device) for i in indices])
        everyone = [torch.empty_like(flat) for _ in range(world)] if mine else None
        dist.gather(flat, everyone, dst=0)
        engine.bytes_sent += flat.numel() * flat.element_size()
        for rank, gathered in enumerate(everyone or ()):
            offset = 0
            for i in indices:
                n = leaves[i].numel()
                values[rank][i] = gathered[offset:offset + n].to(leaves[i].device).view_as(leaves[i]).clone()
                offset += n
    engine.comm_seconds += time.perf_counter() - began
    if not mine:
        return None
    n, m = len(engine.params), len(engine.buffers)
    return [{'params': tensors[:n], 'buffers': tensors[n:n + m], 'optimizer': _with_leaves(state, tensors[n + m:])}
            for tensors in values]
