"""Canary: the private autograd call ``sync/_autograd.py`` relies on still runs code before ``backward()`` returns.

Fails on the pinned torch if it moved; the package then warns once (``_autograd.LOST``) and averages
gradients at the Trial's ``on_backward`` instead.
"""
import warnings

import torch

from torchbearer_dist import _once
from torchbearer_dist.sync import _autograd


def test_a_callback_queued_in_backward_runs_before_backward_returns():
    assert _autograd._engine_queue() is not None, 'torch.autograd.Variable._execution_engine.queue_callback moved'
    order = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda grad: order.append(('queued', _autograd.queue_at_backward_end(lambda: order.append(
        ('ended', x.grad is not None))))))
    y.backward()
    order.append(('returned', None))
    # queued during backward, ran after every gradient was accumulated and before backward() returned
    assert order == [('queued', True), ('ended', True), ('returned', None)]


def test_without_the_private_call_it_warns_once_and_leaves_the_callback_to_the_caller(monkeypatch):
    monkeypatch.setattr(_autograd, '_engine_queue', lambda: None)  # a torch release without it
    _once._given.discard(_autograd.LOST.format(torch.__version__))
    ran = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert _autograd.queue_at_backward_end(lambda: ran.append(1)) is False
        assert _autograd.queue_at_backward_end(lambda: ran.append(2)) is False
    assert ran == []
    lost = [w for w in caught if 'not before backward() returns' in str(w.message)]
    assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning)
