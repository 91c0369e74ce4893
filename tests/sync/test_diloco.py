"""DiLoCo's outer step (sync/diloco.py): the pseudo-gradient average, the outer optimizer, identical replicas.

The references are written out by hand: the anchor minus the mean of the ranks' pseudo-gradients
times the outer learning rate (no momentum), and torch's own SGD with Nesterov momentum on the mean.
"""
import pytest
import torch
from torch import nn

from torchbearer_dist.sync.diloco import PAPER, OuterStep, check_options, check_parameters, gain

from _dist import run_in_step, run_workers, scenario_values, world_of_one  # noqa: I001 (tests/ on sys.path)


@pytest.mark.parametrize('kwargs, message', [
    (dict(outer_lr=0), r'^outer_lr should be a number > 0, but given 0$'),
    (dict(outer_lr='1'), r"^outer_lr should be a number >= 0, but given '1'$"),
    (dict(outer_momentum=1.0), r'^outer_momentum should be a number >= 0 and < 1, but given 1.0$'),
    (dict(nesterov=1), r'^nesterov should be True or False, but given 1$'),
    (dict(compression='int2'), r"^compression should be None, 'fp16', 'bf16', 'int8' or 'int4' \(what "
                               r"pseudo-gradients travel in\), but given 'int2'$"),
    (dict(compression='powersgd'), r"^compression='powersgd' does not combine with local steps"),
])
def test_bad_options_are_refused_in_one_line(kwargs, message):
    options = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression=None)
    options.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_options(**options)


def test_the_default_outer_step_moves_the_anchor_to_the_ranks_average_and_the_paper_is_one_splat_away():
    assert gain(1.0, 0.0) == 1.0 and gain(**{k: PAPER[k] for k in ('outer_lr', 'outer_momentum')}) == \
        pytest.approx(7.0)
    with world_of_one():
        outer = OuterStep(list(nn.Linear(3, 2).parameters()))
        assert outer.outer.defaults['lr'] == 1.0 and outer.outer.defaults['momentum'] == 0.0
        paper = OuterStep(list(nn.Linear(3, 2).parameters()), **PAPER)
        assert (paper.outer.defaults['lr'], paper.outer.defaults['momentum'], paper.outer.defaults['nesterov']) == \
            (0.7, 0.9, True)


def test_an_integer_parameter_is_refused_by_name():
    p = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=r"^parameter 'counts' \(int64, torch.strided\) cannot take local steps"):
        check_parameters([('w', nn.Parameter(torch.zeros(2))), ('counts', p)])


def test_in_a_world_of_one_outer_lr_one_without_momentum_keeps_the_local_weights():
    with world_of_one():
        model = nn.Linear(3, 2)
        outer = OuterStep(list(model.parameters()), outer_lr=1.0, outer_momentum=0.0)
        start = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(0.5)
        local = model.weight.detach().clone()
        assert outer.step() is False
        torch.testing.assert_close(model.weight, local, rtol=0, atol=1e-7)
        torch.testing.assert_close(outer.anchor[0], local, rtol=0, atol=1e-7)
        assert not torch.equal(local, start)


def _local_weights(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    anchor = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.full_like(p, 0.01 * (rank + 1) * (i + 1)))
        model[1].running_mean.fill_(float(rank))
        model[1].num_batches_tracked.fill_(5 + rank)
    return model, anchor


def _scenario_step(compression, momentum, rank):
    model, anchor = _local_weights(rank)
    outer = OuterStep(list(model.parameters()), list(model.buffers()), outer_lr=0.5, outer_momentum=momentum,
                      compression=compression)
    for a, saved in zip(outer.anchor, anchor):
        a.copy_(saved)
    stop = outer.step(stop=rank == 1)
    second = [p.detach().clone() for p in model.parameters()]
    outer.step()
    return {'stop': stop, 'state': {k: v.clone() for k, v in model.state_dict().items()}, 'second': second,
            'anchor': anchor, 'saved': outer.state_dict()}


def _scenario_overlap(compression, rank):
    """begin(), then 0.5 (rank + 1) of local progress on every weight, then finish(carry=True)."""
    model, anchor = _local_weights(rank)
    outer = OuterStep(list(model.parameters()), list(model.buffers()), outer_lr=0.5, outer_momentum=0.9,
                      compression=compression)
    for a, saved in zip(outer.anchor, anchor):
        a.copy_(saved)
    outer.begin()
    progress = 0.5 * (rank + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(progress)
        model[1].running_mean.add_(progress)
    outer.advance()
    outer.finish(carry=True)
    return {'params': [p.detach().clone() for p in model.parameters()], 'anchor': [a.clone() for a in outer.anchor],
            'start': anchor, 'progress': progress, 'running_mean': model[1].running_mean.clone()}


def _worker_steps():
    import torch.distributed as dist
    rank = dist.get_rank()
    scenarios = [('{}_{}'.format(c, m), (lambda c=c, m=m: _scenario_step(c, m, rank)))
                 for c in (None, 'fp16', 'bf16', 'int8', 'int4') for m in (0.0, 0.9)]
    scenarios += [('overlap_{}'.format(c), (lambda c=c: _scenario_overlap(c, rank))) for c in (None, 'int8', 'int4')]
    return run_in_step(scenarios)


@pytest.fixture(scope='module')
def steps():
    return run_workers(_worker_steps, 2, deadline=60)


def _expected_first_step(momentum, anchor):
    """Both ranks' pseudo-gradients by hand: anchor - local = -0.01 (r + 1) (i + 1); the mean over r = 0, 1."""
    mean = [torch.full_like(a, -0.015 * (i + 1)) for i, a in enumerate(anchor)]
    params = [a.clone() for a in anchor]
    for p, g in zip(params, mean):
        p.grad = g
    torch.optim.SGD(params, lr=0.5, momentum=momentum, nesterov=momentum > 0).step()
    return [p.detach() for p in params]


@pytest.mark.parametrize('compression', [None, 'fp16', 'bf16', 'int8', 'int4'])
@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_every_rank_holds_the_same_weights_bit_for_bit_the_outer_step_of_the_mean(steps, compression, momentum):
    rank0, rank1 = scenario_values(steps, '{}_{}'.format(compression, momentum))
    for name in rank0['state']:
        assert torch.equal(rank0['state'][name], rank1['state'][name]), name
    expected = _expected_first_step(momentum, rank0['anchor'])
    tolerance = {None: 1e-7, 'fp16': 1e-4, 'bf16': 2e-3}.get(compression) or _integer_tolerance(compression)
    for got, want in zip(rank0['second'], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    assert rank0['stop'] is True and rank1['stop'] is True  # rank 1 asked; every rank hears it
    # The BatchNorm running mean (0 on rank 0, 1 on rank 1) is averaged; the integer counter is rank 0's.
    assert torch.equal(rank0['state']['1.running_mean'], torch.full((3,), 0.5))
    assert rank0['state']['1.num_batches_tracked'].item() == 5
    assert rank0['saved']['steps'] == 2 and len(rank0['saved']['anchor']) == 4


def test_state_dict_round_trip_restores_the_anchor_and_the_momentum():
    with world_of_one():
        model = nn.Linear(3, 2)
        outer = OuterStep(list(model.parameters()), **PAPER)
        with torch.no_grad():
            model.weight.add_(0.1)
        outer.step()
        saved = outer.state_dict()
        other = OuterStep(list(nn.Linear(3, 2).parameters()), **PAPER)
        other.load_state_dict(saved)
        for a, b in zip(other.anchor, outer.anchor):
            assert torch.equal(a, b)
        momentum = other.outer.state_dict()['state'][0]['momentum_buffer']
        assert torch.equal(momentum, outer.outer.state_dict()['state'][0]['momentum_buffer'])
        with pytest.raises(ValueError, match=r'^the saved anchor holds 2 tensors that do not match the 4 parameters'):
            OuterStep(list(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).parameters())).load_state_dict(saved)


def _integer_tolerance(compression):
    """Half a step (the largest pseudo-gradient, 0.08, over 254 or 14) on the way in, times the outer step's 0.5 x
    (1 + 0.9) of Nesterov's first step; two ranks send whole vectors, so nothing is rounded on the way out."""
    return 0.5 * 1.9 * 0.08 / {'int8': 254, 'int4': 14}[compression]


@pytest.mark.parametrize('compression', [None, 'int8', 'int4'])
def test_a_meeting_that_lands_later_steps_the_anchor_and_keeps_each_ranks_progress_since(steps, compression):
    rank0, rank1 = scenario_values(steps, 'overlap_{}'.format(compression))
    for a, b in zip(rank0['anchor'], rank1['anchor']):
        assert torch.equal(a, b)  # the anchors agree bit for bit
    expected = _expected_first_step(0.9, rank0['start'])  # the mean of the pseudo-gradients taken at begin()
    tolerance = 1e-6 if compression is None else _integer_tolerance(compression)
    for rank in (rank0, rank1):
        for got, anchor, want in zip(rank['params'], rank['anchor'], expected):
            torch.testing.assert_close(anchor, want, rtol=0, atol=tolerance)
            torch.testing.assert_close(got, anchor + rank['progress'], rtol=0, atol=1e-6)  # its own progress kept
        # the running mean: 0 and 1 averaged at begin(), plus what each rank added since
        torch.testing.assert_close(rank['running_mean'], torch.full((3,), 0.5 + rank['progress']), rtol=0, atol=1e-6)
