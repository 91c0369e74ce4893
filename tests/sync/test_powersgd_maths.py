"""PowerSGD's maths on one process (sync/powersgd.py): a real gloo world of one rank, where the mean
over ranks is the identity, so what is left is the low-rank approximation and its error feedback.

The two-rank behaviour (replicas bit-identical, agreement with torch's DDP hook) is in test_powersgd.py.
"""
import pytest
import torch
from torch import nn

from torchbearer_dist.sync.powersgd import PowerSGD, _orthonormalize

from _dist import world_of_one


@pytest.fixture(autouse=True)
def world():
    with world_of_one():
        yield


def _matrix(n, m, rank=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(n, m, generator=generator)
    return torch.randn(n, rank, generator=generator) @ torch.randn(rank, m, generator=generator)


def _param(n, m):
    return nn.Parameter(torch.zeros(n, m))


def test_orthonormalize_gives_orthonormal_columns():
    matrix = _matrix(30, 4)
    _orthonormalize(matrix, 1e-8)
    torch.testing.assert_close(matrix.t() @ matrix, torch.eye(4), atol=1e-5, rtol=0)


def test_an_all_zero_gradient_gives_zeros_not_nan():
    p = _param(20, 20)
    powersgd = PowerSGD([p], matrix_approximation_rank=2, start_iter=0)
    p.grad = torch.zeros(20, 20)
    powersgd.reduce()
    assert torch.equal(p.grad, torch.zeros(20, 20))


def test_a_gradient_of_rank_at_most_r_comes_back_exactly():
    p = _param(40, 30)
    powersgd = PowerSGD([p], matrix_approximation_rank=3, start_iter=0)
    grad = _matrix(40, 30, rank=3)
    p.grad = grad.clone()
    powersgd.reduce()
    torch.testing.assert_close(p.grad, grad, atol=1e-4, rtol=1e-4)


def test_the_update_has_rank_r_and_the_error_keeps_the_rest():
    p = _param(40, 30)
    powersgd = PowerSGD([p], matrix_approximation_rank=2, start_iter=0)
    grad = _matrix(40, 30)
    p.grad = grad.clone()
    powersgd.reduce()
    assert torch.linalg.matrix_rank(p.grad).item() == 2
    torch.testing.assert_close(p.grad + powersgd._errors[0], grad, atol=1e-5, rtol=1e-5)


def test_error_feedback_makes_the_updates_add_up_to_the_gradients():
    """sum of updates = sum of gradients - the last error, exactly; the error stays bounded, so the
    mean update tends to the gradient (rank 1 of a 40 x 30 matrix: 18 % off after 100 steps)."""
    p = _param(40, 30)
    powersgd = PowerSGD([p], matrix_approximation_rank=1, start_iter=0)
    grad = _matrix(40, 30)
    total = torch.zeros(40, 30)
    for step in range(1, 101):
        p.grad = grad.clone()
        powersgd.reduce()
        total += p.grad
        torch.testing.assert_close(total + powersgd._errors[0], step * grad, atol=1e-3, rtol=1e-4)
    relative = (total / 100 - grad).norm() / grad.norm()
    assert relative < 0.25, relative


def test_without_error_feedback_the_error_is_lost():
    p = _param(40, 30)
    powersgd = PowerSGD([p], matrix_approximation_rank=1, start_iter=0, error_feedback=False)
    grad = _matrix(40, 30)
    total = torch.zeros(40, 30)
    for _ in range(100):
        p.grad = grad.clone()
        powersgd.reduce()
        total += p.grad
    assert (total / 100 - grad).norm() / grad.norm() > 0.8  # 94 %: the rank-1 part only, every step


def test_the_first_start_iter_steps_are_exact_and_compression_starts_after():
    p = _param(40, 30)
    powersgd = PowerSGD([p], matrix_approximation_rank=1, start_iter=2)
    grad = _matrix(40, 30)
    exact = []
    for _ in range(3):
        p.grad = grad.clone()
        powersgd.reduce()
        exact.append(torch.equal(p.grad, grad))
    assert exact == [True, True, False]


def test_vectors_and_small_matrices_travel_uncompressed():
    big, bias, small = _param(100, 100), nn.Parameter(torch.zeros(100)), _param(3, 3)
    powersgd = PowerSGD([big, bias, small], matrix_approximation_rank=4, min_compression_rate=2.0)
    assert [index for index, *_ in powersgd.matrices] == [0]
    assert powersgd.dense == [1, 2]
    # uncompressed values, P (100 x 4), one flag per parameter and the stop flag; then Q (100 x 4)
    assert powersgd.compressed_numel == (100 + 9) + 400 + 3 + 1 + 400
    bias.grad, small.grad, big.grad = torch.randn(100), torch.randn(3, 3), _matrix(100, 100)
    expected = bias.grad.clone(), small.grad.clone()
    for _ in range(3):
        powersgd.reduce()
    assert torch.equal(bias.grad, expected[0]) and torch.equal(small.grad, expected[1])


def test_a_parameter_without_gradient_keeps_none_and_stop_travels():
    used, unused = _param(40, 30), _param(40, 30)
    powersgd = PowerSGD([used, unused], matrix_approximation_rank=2, start_iter=1)
    for _ in range(2):  # one uncompressed step, one compressed
        used.grad, unused.grad = _matrix(40, 30), None
        assert powersgd.reduce(stop=True) is True
        assert used.grad is not None and unused.grad is None
    used.grad = _matrix(40, 30)
    assert powersgd.reduce() is False


def test_same_seed_same_result_bit_for_bit():
    """Every rank draws the same initial Q: two instances given the same gradients agree exactly."""
    results = []
    for _ in range(2):
        p = _param(40, 30)
        powersgd = PowerSGD([p], matrix_approximation_rank=2, start_iter=0, seed=7)
        for step in range(3):
            p.grad = _matrix(40, 30, seed=step)
            powersgd.reduce()
        results.append(p.grad.clone())
    assert torch.equal(results[0], results[1])
