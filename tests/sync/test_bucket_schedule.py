"""The bucket schedule: closed after the tensor that fills a bucket, then rebuilt in measured gradient-ready order."""
import torch
import torch.distributed as dist
import torchbearer
from torch import nn

import torchbearer_dist
from torchbearer_dist.sync.flat_buckets import pack

from _dist import run_in_step, run_workers, scenario_values


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 64), nn.ReLU(),
                         nn.Linear(64, 3))


def _names(model, buckets):
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b.params] for b in buckets]


def test_a_bucket_closes_after_the_tensor_that_fills_it():
    model = _cnn()
    # 2 KiB first bucket: the 64x144 weight (36 KiB) fills it and closes it, as in DDP; the convolution goes next
    buckets = pack(list(reversed(list(model.parameters()))), 25.0, 2 / 1024)
    assert _names(model, buckets) == [['5.bias', '5.weight', '3.bias', '3.weight'], ['0.bias', '0.weight']]


def _train(first_bucket_mb):
    model = _cnn()
    generator = torch.Generator().manual_seed(5 + dist.get_rank())
    batches = [(torch.randn(4, 1, 8, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator))
               for _ in range(4)]
    callbacks = torchbearer_dist.distributed_callbacks(first_bucket_mb=first_bucket_mb, overlap=True)
    trial = torchbearer.Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                              callbacks=callbacks, verbose=0)
    trial.with_train_generator(batches)
    trial.run(1)
    return _names(model, callbacks[-1].buckets.buckets), [p.detach().clone() for p in model.parameters()]


def _worker():
    return run_in_step([('small first bucket', lambda: _train(2 / 1024)), ('one bucket', lambda: _train(25.0))])


def test_buckets_follow_gradient_ready_order_and_average_exactly():
    per_rank = run_workers(_worker, 2)
    (order0, params0), (order1, params1) = scenario_values(per_rank, 'small first bucket')
    # After the first step the buckets hold the parameters in the order their gradients arrived on rank 0
    # (a convolution's weight gradient before its bias's: one autograd node accumulates both in that order),
    # the same on every rank.
    assert order0 == order1
    assert sorted(sum(order0, [])) == sorted(n for n, _ in _cnn().named_parameters())
    assert order0[-1] == ['0.weight', '0.bias']
    (_, one), _ = scenario_values(per_rank, 'one bucket')
    for a, b, c in zip(params0, params1, one):
        assert torch.equal(a, b) and torch.equal(a, c)  # the schedule changes when values travel, not the sum
