"""Keeping the ranks consistent: equal batch counts each epoch, and a check that replicas agree."""
import warnings

import torch
import torch.distributed as dist
import torchbearer
from torchbearer import Callback

from torchbearer_dist import comm
from torchbearer_dist.comm import unwrap


class EvenBatches(Callback):
    """Make every rank run the same number of training batches each epoch.

    Ranks whose loaders differ in length (a non-padding sampler, datasets of different sizes) would
    otherwise leave the longer rank waiting in a collective until the timeout, while the shorter
    one exits cleanly. One all-reduce per epoch compares the counts.

    Example: ::

        >>> from torchbearer_dist import EvenBatches
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[EvenBatches(policy='error')])

    Args:
        policy (str): ``'min'`` (every rank stops at the shortest count, said once) or ``'error'``
            (every rank raises before the first step, naming both counts)

    Raises:
        ValueError: an unknown policy, or with ``policy='error'`` unequal counts

    .. warning:: A synchronization point at each epoch start.
    """

    def __init__(self, policy='min'):
        super().__init__()
        if policy not in ('min', 'error'):
            raise ValueError("policy should be 'min' or 'error', but given {!r}".format(policy))
        self.policy = policy
        self._warned = False

    def on_start_training(self, state):
        steps = state[torchbearer.STEPS]
        if comm.world_size() == 1 or steps is None or steps < 0:
            return
        fewest, most = comm.reduce_int(steps, 'min'), comm.reduce_int(steps, 'max')
        if fewest == most:
            return
        if self.policy == 'error':
            raise ValueError('ranks have unequal numbers of training batches (fewest {}, most {}; this rank {}); '
                             'use a DistributedSampler, or EvenBatches(policy="min")'.format(fewest, most, steps))
        if not self._warned and comm.rank() == 0:
            warnings.warn('ranks have unequal numbers of training batches (fewest {}, most {}): every rank stops '
                          'after {} this epoch'.format(fewest, most, fewest), stacklevel=2)
        self._warned = True
        state[torchbearer.STEPS] = fewest


class CheckReplicas(Callback):
    """Check every ``every`` steps that parameters agree across ranks, and buffers too at each epoch end.

    One small all-reduce of two checksums per tensor; on a difference every rank raises, naming the
    first tensor that differs. Catches an update made on one rank only (a callback that touches the
    model locally, a buffer that drifts). Buffers such as BatchNorm statistics are compared only at
    the epoch end, after :class:`AllReduceGradients` has re-broadcast them from rank 0.

    Example: ::

        >>> from torchbearer_dist import CheckReplicas
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[CheckReplicas(every=100)])

    Args:
        every (int): steps between checks; also checked at each epoch end

    Raises:
        ValueError: ``every`` is not a positive integer

    .. warning:: A synchronization point every ``every`` steps.
    """

    def __init__(self, every=100):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError('every should be an integer >= 1, but given {!r}'.format(every))
        self.every = every
        self._steps = 0

    def on_step_training(self, state):
        self._steps += 1
        if self._steps % self.every == 0:
            check_replicas(unwrap(state[torchbearer.MODEL]), buffers=False)

    def on_end_epoch(self, state):
        check_replicas(unwrap(state[torchbearer.MODEL]))


def check_replicas(module, buffers=True):
    """Check that parameters (and buffers) hold the same values on every rank.

    Each tensor is summarised by two float64 checksums (its sum and a position-weighted sum);
    one MAX all-reduce of them and their negatives compares every rank at once.

    Args:
        module (torch.nn.Module): the local replica
        buffers (bool): also compare buffers (BatchNorm statistics drift apart within a training
            pass by design, until :class:`~torchbearer_dist.AllReduceGradients` re-broadcasts them)

    Raises:
        RuntimeError: naming the first tensor whose values differ across ranks

    .. warning:: A synchronization point: every rank must call it.
    """
    if comm.world_size() == 1:
        return
    entries = list(module.state_dict().items()) if buffers else list(module.named_parameters())
    sums = []
    with torch.no_grad():
        for _, tensor in entries:
            values = tensor.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
            sums.append(torch.stack([values.sum(), (values * weights).sum()]))
    device = comm.comm_device(comm.module_device(module))
    local = torch.stack(sums).reshape(-1).to(device) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = local.numel()
    differs = (both[:n] != -both[n:]).reshape(-1, 2).any(dim=1).tolist()
    if any(differs):
        first = differs.index(True)
        raise RuntimeError("replicas diverged: '{}' differs across ranks (first of {} differing tensors); "
                           "something updated the model on one rank only".format(entries[first][0], sum(differs)))
