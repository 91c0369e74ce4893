"""Bucket layout and the gradient engine on one process (sync/flat_buckets.py, sync/buckets.py).

Packing, copying in and handing back are plain tensor code: tested here without processes. The
engine's collectives run in a real gloo world of one rank, where a sum over ranks is the identity,
so each test sees exactly what the engine does around the all-reduce.
"""
import pytest
import torch
from torch import nn

from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import FlatBucket, check_options, check_supported, pack, ready_order

from _dist import world_of_one

MB = 2 ** 20


def _floats(*counts, dtype=torch.float32):
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in counts]


def test_a_bucket_closes_after_the_tensor_that_reaches_its_cap():
    quarter = MB // 4 // 4  # float32 values in a quarter MiB
    params = _floats(quarter, quarter, 3 * quarter, quarter, quarter)
    buckets = pack(params, cap_mb=1, first_mb=0.5)
    # first bucket: 0.25 + 0.25 reaches 0.5; then 0.75 + 0.25 reaches 1; the last one is left over
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in buckets] == [[0, 1], [2, 3], [4]]
    assert [b.last for b in buckets] == [False, False, True]


def test_a_change_of_dtype_closes_the_bucket_and_complex_packs_with_its_real_dtype():
    params = [*_floats(3), *_floats(2, dtype=torch.float64), nn.Parameter(torch.zeros(2, dtype=torch.complex128))]
    buckets = pack(params, cap_mb=25, first_mb=25)
    assert [len(b.params) for b in buckets] == [1, 2]
    assert buckets[1].flat.dtype == torch.float64


def test_layout_gradients_then_one_flag_per_parameter_then_the_signal_and_stop_flags():
    a, b = _floats(3, 5)
    (bucket,) = pack([a, b], 25, 1)
    assert (bucket.numel, bucket.flat.numel(), bucket.flags.numel()) == (8, 8 + 2 + 2, 2)
    assert bucket.signal.data_ptr() == bucket.flat[-2:].data_ptr() and bucket.signal.numel() == 1
    assert [v.shape for v in bucket.views] == [a.shape, b.shape]
    not_last = FlatBucket([a, b], last=False)
    assert not_last.flat.numel() == 8 + 2 and not_last.signal is None


def test_complex_parameters_start_at_an_even_offset_and_round_trip():
    odd = nn.Parameter(torch.zeros(3))
    z = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    bucket = FlatBucket([odd, z], last=True)
    assert bucket.numel == 4 + 8  # 3 values, one slot of padding, 4 complex values of 2 slots
    grad = torch.randn(2, 2, dtype=torch.complex64)
    z.grad, odd.grad = grad.clone(), torch.ones(3)
    assert bucket.fill() is False
    torch.testing.assert_close(torch.view_as_complex(bucket.flat[4:12].view(2, 2, 2)), grad)


def test_fill_copies_every_gradient_and_makes_each_grad_a_view_of_the_bucket():
    a, b = _floats(3, 2)
    a.grad, b.grad = torch.tensor([1., 2., 3.]), torch.tensor([4., 5.])
    (bucket,) = pack([a, b], 25, 1)
    assert bucket.fill() is False
    assert bucket.grads.tolist() == [1., 2., 3., 4., 5.]
    bucket.unpack()
    assert a.grad.data_ptr() == bucket.flat.data_ptr()


def test_a_missing_gradient_is_zero_filled_and_reported():
    a, b = _floats(2, 2)
    a.grad = torch.tensor([1., 2.])
    (bucket,) = pack([a, b], 25, 1)
    assert bucket.fill() is True
    assert bucket.grads.tolist() == [1., 2., 0., 0.]
    assert bucket.present == [True, False]


def test_unpack_leaves_none_where_no_rank_had_a_gradient():
    a, b = _floats(2, 2)
    a.grad = torch.ones(2)
    (bucket,) = pack([a, b], 25, 1)
    bucket.fill()
    bucket.missing = True
    bucket.flags.copy_(torch.tensor([1., 0.]))  # what the all-reduce of the presence flags returns
    bucket.unpack()
    assert a.grad is not None and b.grad is None


def test_a_sparse_gradient_goes_in_dense_and_comes_back_sparse():
    embedding = nn.Embedding(5, 2, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    expected = embedding.weight.grad.to_dense()
    (bucket,) = pack([embedding.weight], 25, 1)
    bucket.fill()
    bucket.unpack()
    assert embedding.weight.grad.is_sparse
    torch.testing.assert_close(embedding.weight.grad.to_dense(), expected)


@pytest.mark.parametrize('args, message', [
    ((0, None, 'auto'), r'bucket_cap_mb should be a positive number of MiB, but given 0'),
    ((True, None, 'auto'), r'bucket_cap_mb should be a positive number of MiB, but given True'),
    ((25, 'int8', 'auto'), r"compression should be None, 'fp16', 'bf16' or 'powersgd', but given 'int8'"),
    ((25, None, 'sometimes'), r"overlap should be True, False or 'auto', but given 'sometimes'"),
])
def test_bad_options_name_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        check_options(*args)


def test_integer_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match=r"parameter 'steps' \(int64, torch.strided\) cannot be averaged"):
        check_supported([('steps', torch.zeros(2, dtype=torch.int64))])


def test_ready_order_is_none_when_the_buckets_already_follow_it():
    with world_of_one():
        params = _floats(1, 1, 1)
        buckets = pack(list(reversed(params)), 25, 1)
        assert ready_order(params, list(reversed(params)), buckets) is None
        # gradients arrived as 0, 2; parameter 1 never did: it goes last
        assert ready_order(params, [params[0], params[2]], buckets) == [params[0], params[2], params[1]]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, buckets, x):
    buckets.arm()
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    buckets.disarm()
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize('overlap', [False, True])
@pytest.mark.parametrize('compression, tolerance', [(None, 0), ('fp16', 1e-3), ('bf16', 1e-2)])
def test_a_world_of_one_hands_back_its_own_gradients(compression, tolerance, overlap):
    x = torch.randn(5, 4)
    reference = _model()
    reference(x).pow(2).sum().backward()
    model = _model()
    with world_of_one():
        buckets = GradientBuckets(list(model.parameters()), bucket_cap_mb=0.0001, first_bucket_mb=0.0001,
                                  compression=compression, overlap=overlap)
        buckets.attach(model)
        for _ in range(2):  # the second step runs on buckets repacked in gradient-ready order
            grads = _step(model, buckets, x)
            for got, p in zip(grads, reference.parameters()):
                torch.testing.assert_close(got, p.grad, atol=tolerance, rtol=tolerance)
        assert (buckets.stop, buckets.nonfinite) == (False, False)
        buckets.detach()


def test_a_non_finite_average_clears_every_gradient():
    model = _model()
    with world_of_one():
        buckets = GradientBuckets(list(model.parameters()), overlap=False)
        buckets.attach(model)
        grads = _step(model, buckets, torch.tensor([[float('inf'), 0., 0., 0.]]))
        assert buckets.nonfinite and grads == [None] * 4


def test_a_stop_request_travels_with_the_gradients():
    model = _model()
    with world_of_one():
        buckets = GradientBuckets(list(model.parameters()), overlap=False)
        buckets.attach(model)
        buckets.request_stop()
        _step(model, buckets, torch.randn(3, 4))
        assert buckets.stop
        _step(model, buckets, torch.randn(3, 4))
        assert not buckets.stop  # one request, one stop


def test_a_second_backward_in_one_step_is_averaged_too():
    """A GAN's closure runs two backward passes in one step: each ends with its gradients averaged."""
    model = _model()
    with world_of_one():
        buckets = GradientBuckets(list(model.parameters()), overlap=False)
        buckets.attach(model)
        buckets.arm()
        model(torch.randn(2, 4)).sum().backward()
        first = [p.grad.clone() for p in model.parameters()]
        model(torch.randn(2, 4)).sum().backward()  # accumulates onto the first pass's gradients
        assert buckets.backwards == 2 and buckets.synced
        assert all(not torch.equal(p.grad, g) for p, g in zip(model.parameters(), first))
        buckets.detach()
