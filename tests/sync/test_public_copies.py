"""The bucket fill copies with public torch calls (it used the private ``torch._foreach_copy_``)."""
import torch

from torchbearer_dist.sync.flat_buckets import pack


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape)) for shape in [(3, 4), (5,), (2, 2, 2), (1,)]]


def test_fill_copies_every_gradient_into_its_bucket_and_hands_back_views():
    params = _params()
    for p in params:
        p.grad = torch.randn_like(p)
    buckets = pack(params, 1.0, 1.0)
    for bucket in buckets:
        bucket.pending = len(bucket.params)
        assert bucket.fill() is False
        assert torch.equal(bucket.grads, torch.cat([p.grad.reshape(-1) for p in bucket.params]))
        bucket.unpack()
        for p, view in zip(bucket.params, bucket.views):
            assert p.grad.data_ptr() == view.data_ptr()
        p0 = bucket.params[0]
        p0.grad.mul_(2)  # a gradient already in its view: filling again leaves it, doubled, in place
        bucket.reset()
        bucket.pending = len(bucket.params)
        bucket.fill()
        assert torch.equal(bucket.views[0], p0.grad)
    assert sum(b.numel for b in buckets) == sum(p.numel() for p in params)
