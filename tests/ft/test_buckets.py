"""The fault-tolerant mode's gradient buckets, over a stand-in Replica and Manager: no process, no torchft.

The stand-in plays one other replica of the quorum, whose gradients are all ones: each bucket's all-reduce,
once waited for, holds (this replica's + 1) / 2. The model's last layer fills the first bucket (1 MiB, as
the fail-fast mode's); the first layer and a layer the forward pass never uses share the second.
"""
import copy

import pytest
import torch
import torchbearer
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial

from torchbearer_dist.ft import FaultTolerantAllReduce
from torchbearer_dist.ft import callback as ft_callback


class _Manager:
    def __init__(self, events):
        self.events, self._quorum_id = events, 1

    def current_step(self):
        return 0

    def participating_rank(self):
        return 0

    def num_participants(self):
        return 1

    def should_commit(self):
        return True

    def errored(self):
        return None

    def allreduce(self, tensor, reduce_op):
        self.events.append(('send', tensor.numel()))
        return _Work(self.events, tensor, reduce_op == torch.distributed.ReduceOp.AVG)


class _Work:
    def __init__(self, events, tensor, average):
        self.events, self.tensor, self.average = events, tensor, average

    def wait(self):
        self.events.append(('wait', self.tensor.numel()))
        if self.average:  # metrics are summed: this replica's alone
            self.tensor.add_(1).div_(2)
        return True


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(16, 2)  # registered first: in the last bucket, with the first layer
        self.first = torch.nn.Linear(16, 16)
        self.last = torch.nn.Linear(16, 20000)  # 320,000 weights: 1.2 MiB, the first bucket on its own

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


class _Seen(Callback):
    """A user's on_backward callback, listed before ours: when it runs, the gradients it sees."""

    def __init__(self, events):
        super().__init__()
        self.events, self.grads = events, None

    def on_backward(self, state):
        self.events.append(('on_backward',))
        self.grads = {n: p.grad.clone() for n, p in state[torchbearer.MODEL].named_parameters()}


def _loss(y_pred, y_true):
    return y_pred.pow(2).mean()


@pytest.fixture(scope='module')
def step():
    """One training step: the events in order, the gradients a user's callback saw, the local gradients."""
    events, monkeypatch = [], pytest.MonkeyPatch()

    class Replica:
        def __init__(self, *args, group=None, deferred=False):
            self.manager, self.group = _Manager(events), None  # no process group: sums through the Manager

        def start_quorum(self, shrink_only=False, heal=True, wait=True, load=True):
            events.append(('quorum',))

        def finish_quorum(self, load=False):
            pass

        def members(self):
            return 0, 1

        def should_commit(self):
            return self.manager.should_commit()

        def shutdown(self):
            pass

    monkeypatch.setattr(ft_callback, 'Replica', Replica)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 16)
    reference = copy.deepcopy(net)
    _loss(reference(x), None).backward()
    net.first.weight.register_post_accumulate_grad_hook(lambda p: events.append(('first layer',)))
    seen = _Seen(events)
    trial = Trial(net, torch.optim.SGD(net.parameters(), lr=0.1), _loss,
                  callbacks=[seen, FaultTolerantAllReduce('127.0.0.1:1', replica_id='r0')])
    try:
        trial.with_generators(DataLoader(TensorDataset(x, torch.zeros(4)), batch_size=4)).run(1, verbose=0)
    finally:
        monkeypatch.undo()
    return events, seen.grads, {n: p.grad for n, p in reference.named_parameters()}


def test_the_last_layers_bucket_is_sent_before_backward_reaches_the_first_layer(step):
    events = step[0]
    last, rest = 20000 * 17 + 2, 2 * 17 + 16 * 17 + 4 + 2  # gradients, a presence flag each, the last's 2 slots
    sends = [e for e in events if e[0] == 'send']
    assert sends[:2] == [('send', last), ('send', rest)]  # the buckets in reverse registration order
    first_layer = events.index(('first layer',))
    assert events.index(('send', last)) < first_layer < events.index(('send', rest))
    assert events.index(('wait', last)) < events.index(('wait', rest)) < events.index(('on_backward',))


def test_every_gradient_is_the_average_a_missing_one_counted_as_zeros(step):
    _, seen, local = step
    assert set(seen) == {'unused.weight', 'unused.bias', 'first.weight', 'first.bias', 'last.weight', 'last.bias'}
    for name, grad in local.items():
        if grad is None:
            torch.testing.assert_close(seen[name], torch.full_like(seen[name], 0.5))
        else:
            torch.testing.assert_close(seen[name], (grad + 1) / 2)
    assert local['unused.weight'] is None


def test_a_steps_quorum_is_asked_for_before_forward_and_taken_before_its_first_bucket_travels():
    # torchft's asynchronous quorum: the run's first quorum is waited for at its start (it may heal), every later
    # step's forms while forward runs and is taken (its vote, where new) before the step's first all-reduce.
    events, monkeypatch = [], pytest.MonkeyPatch()

    class Alone(_Manager):  # nobody else: every all-reduce leaves the tensor as it is (no stop asked)
        def allreduce(self, tensor, reduce_op):
            self.events.append(('send', tensor.numel()))
            return _Work(self.events, tensor, False)

    class Replica:
        def __init__(self, *args, group=None, deferred=False):
            self.manager, self.deferred, self.group = Alone(events), deferred, None

        def start_quorum(self, shrink_only=False, heal=True, wait=True, load=True):
            events.append(('ask', wait))

        def finish_quorum(self, load=False):
            events.append(('take',))

        def members(self):
            return 0, 1

        def should_commit(self):
            return True

        def shutdown(self):
            pass

    class Forward(Callback):
        def on_forward(self, state):
            events.append(('forward',))

    monkeypatch.setattr(ft_callback, 'Replica', Replica)
    torch.manual_seed(0)
    x, net = torch.randn(8, 16), _Net()
    trial = Trial(net, torch.optim.SGD(net.parameters(), lr=0.1), _loss,
                  callbacks=[Forward(), FaultTolerantAllReduce('127.0.0.1:1', replica_id='r0')])
    try:
        trial.with_generators(DataLoader(TensorDataset(x, torch.zeros(8)), batch_size=4)).run(1, verbose=0)
    finally:
        monkeypatch.undo()
    marks = [e[0] for e in events if e[0] in ('ask', 'take', 'forward', 'send')]
    marks = [m for i, m in enumerate(marks) if m != 'send' or marks[i - 1] != 'send']  # a step's first send
    asks = [e[1] for e in events if e[0] == 'ask']
    assert asks == [True, False] and marks == ['ask', 'take', 'forward', 'send',  # the run's start: waited for
                                               "ask", "forward", "take", "send"], (asks, marks)
