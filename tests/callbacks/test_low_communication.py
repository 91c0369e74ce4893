"""DiLoCo in a Trial (issue 27, items 1-3): the one equivalence, identical replicas, the stop, an exact resume.

Every scenario runs in one start of two real gloo ranks. The equivalence that holds: one local step,
outer SGD at learning rate 1 without momentum, plain SGD inside, is gradient averaging, so 2 ranks
at batch B match one process at batch 2B. The resume: a run interrupted after a step checkpoint
written between two outer steps, resumed in fresh objects, ends bit-identical to one never interrupted.
"""
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback

import torchbearer_dist
from torchbearer_dist import CheckReplicas, DiLoCo, distributed_callbacks
from torchbearer_dist.sync import stop_flag, wire

from _dist import run_in_step, run_workers, scenario_values  # noqa: I001 (tests/ on sys.path)

B = 4
STEPS = 10
EPOCHS = 2
N = 2 * B * STEPS
LR = 0.1
SEED = 100


def _data():
    generator = torch.Generator().manual_seed(123)
    return torch.randn(N, 6, generator=generator), torch.randint(0, 3, (N,), generator=generator)


def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == 'bn':
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    if kind == 'bn-no-dropout':  # no RNG drawn in training: the same steps whatever the loaders drew
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _snapshot(model):
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _reference():
    """One process, batch 2B, plain SGD, the same samples in the same order."""
    x, y = _data()
    model = _model('mlp', SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=2 * B):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return _snapshot(model)


class _StopOn(Callback):
    """Sets STOP_TRAINING on rank ``rank`` at batch ``batch`` of the first epoch; counts the batches trained."""

    def __init__(self, rank, batch):
        super().__init__()
        self.rank, self.batch, self.trained = rank, batch, 0

    def on_step_training(self, state):
        self.trained += 1
        if dist.get_rank() == self.rank and state[torchbearer.BATCH] == self.batch:
            state[torchbearer.STOP_TRAINING] = True


class _Interrupted(Exception):
    pass


class _InterruptAt(Callback):
    """Raises on every rank after training step ``at`` of the run (a crash every rank sees at the same step)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.steps = at, 0

    def on_step_training(self, state):
        self.steps += 1
        if self.steps == self.at:
            raise _Interrupted()


def _trial(kind, options, optimizer=None, extra=(), shuffle=False, epochs=EPOCHS, checkpoint=None, resume=False,
           callbacks=None, every_steps=4, repeats=1, validation=False):
    rank = dist.get_rank()
    model = _model(kind, SEED + rank)  # differently seeded ranks: BroadcastParameters is part of what is checked
    dataset = TensorDataset(*[torch.cat([t] * repeats) for t in _data()])
    loader = DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=shuffle, seed=5))
    optimizer = optimizer(model) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=LR)
    callbacks = list(extra) + (callbacks if callbacks is not None else distributed_callbacks(**options))
    if checkpoint is not None:
        callbacks.insert(0, torchbearer_dist.Checkpoint(checkpoint, every_steps=every_steps))
    trial = torchbearer.Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss'], callbacks=callbacks,
                              verbose=0).with_train_generator(loader)
    if validation:
        trial.with_val_generator(DataLoader(TensorDataset(*_data()), batch_size=B))
    if resume:
        torchbearer_dist.load_checkpoint(checkpoint, trial=trial)
    try:
        trial.run(epochs)
    except _Interrupted:
        pass
    return model, callbacks


class _Count(Callback):
    """A user's own callback: counts the training steps it sees."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_step_training(self, state):
        self.steps += 1


def _equivalence(**options):
    """DiLoCo at H=1, in fp32 unless ``options`` name a wire, every other option at its default."""
    before, after = _Count(), _Count()  # the user's callbacks on both sides of ours
    options = dict(dict(local_steps=1, compression=None), **options)
    model, _ = _trial('mlp', None, extra=[before], callbacks=distributed_callbacks(**options) + [after])
    return {'state': _snapshot(model), 'steps': (before.steps, after.steps)}


class _History(Callback):
    """Keeps the history a run ends with."""

    def on_end(self, state):
        self.history = [dict(entry) for entry in state[torchbearer.HISTORY]]


def _nesterov_bn():
    history = _History()
    model, callbacks = _trial('bn', dict(local_steps=3, **DiLoCo.PAPER),
                              optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9), extra=[history])
    return {'state': _snapshot(model), 'outer_steps': callbacks[-1].engine.steps,
            'comm_bytes': [entry.get('comm_bytes') for entry in history.history],
            'rates': [entry.get('comm_mbit_s') for entry in history.history]}


def _stop():
    stopper = _StopOn(rank=1, batch=1)
    stop_flag.PERIOD = 2  # this scenario only: a flag every 2 steps (8 by default), within a 10-step epoch
    try:
        model, _ = _trial('mlp', dict(local_steps=8), extra=[stopper])
    finally:
        stop_flag.PERIOD = 8
    return {'trained': stopper.trained, 'state': _snapshot(model)}


class _SecondModel(Callback):
    """A GAN-like second model and optimizer under keys of the program's own, stepped inside every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7 + dist.get_rank())
        self.critic = nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.critic.parameters(), lr=LR)

    def on_start(self, state):
        state[torchbearer.state_key('critic')] = self.critic
        state[torchbearer.state_key('critic_optimizer')] = self.optimizer

    def on_backward(self, state):
        self.optimizer.zero_grad()
        self.critic(state[torchbearer.Y_PRED].detach()).pow(2).mean().backward()
        self.optimizer.step()


def _second_model():
    second = _SecondModel()
    initial = second.critic.weight.detach().clone()
    _trial('mlp', dict(local_steps=3), extra=[second])
    return {'critic': _snapshot(second.critic), 'initial': initial}


def _no_hooks():
    class Wrapper:  # an optimizer wrapper without torch's step hooks
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def zero_grad(self):
            self.optimizer.zero_grad()

        def step(self, closure=None):
            return self.optimizer.step(closure)

    try:
        _trial('mlp', dict(local_steps=2), optimizer=lambda m: Wrapper(torch.optim.SGD(m.parameters(), lr=LR)))
    except ValueError as e:
        return str(e)
    return None


def _check_replicas():
    try:
        _trial('mlp', dict(local_steps=2), extra=[CheckReplicas(every=3)])
    except ValueError as e:
        return str(e)
    return None


def _resume(directory, overlap_steps=0, every_steps=4, cut=6):
    """Uninterrupted; interrupted at step 6 (the last checkpoint at step 4, 1 after an outer step); resumed.

    With ``overlap_steps=2`` the meeting that began at step 3 is in flight at the checkpoint (it lands at 5).
    With ``every_steps=None, cut=13`` the checkpoint is the first epoch's end, step 10, 1 after an outer step.
    """
    torch.manual_seed(0)
    sgd = _momentum_sgd
    # the outer momentum is state a resume must restore too
    options = dict(local_steps=3, overlap_steps=overlap_steps, **DiLoCo.PAPER)
    name = '{}-{}.pt'.format(overlap_steps, every_steps)
    whole, _ = _trial('bn', options, optimizer=sgd, shuffle=True, extra=[_InterruptAt(None)],
                      checkpoint=os.path.join(directory, 'whole' + name), every_steps=every_steps, validation=True)
    torch.manual_seed(0)
    path = os.path.join(directory, 'cut' + name)
    _trial('bn', options, optimizer=sgd, shuffle=True, checkpoint=path, extra=[_InterruptAt(cut)],
           every_steps=every_steps, validation=True)
    saved = torch.load(path, weights_only=True) if dist.get_rank() == 0 else None
    torch.manual_seed(1)  # the resumed run owes nothing to this process's RNG
    resumed, _ = _trial('bn', options, optimizer=sgd, shuffle=True, checkpoint=path, resume=True,
                        extra=[_InterruptAt(None)], every_steps=every_steps, validation=True)  # their states restore
    diloco = None if saved is None else next(e['state'] for e in saved['callbacks'] if e['type'].endswith('.DiLoCo'))
    return {'whole': _snapshot(whole), 'resumed': _snapshot(resumed), 'position': saved and saved.get('position'),
            'inner_steps': diloco and diloco['inner_steps'], 'local': diloco and len(diloco['local'] or ()),
            'meeting': diloco and diloco.get('meeting') and diloco['meeting']['due'],
            'dtypes': diloco and sorted({str(t.dtype) for entry in diloco['local'] for t in
                                         entry['params'] + entry['buffers'] + [
                                             v for s in entry['optimizer']['state'].values() for v in s.values()]})}


class _AtStart(Callback):
    """Copies the model's parameters and DiLoCo's anchor when the first training pass starts (after DiLoCo's)."""

    def __init__(self, diloco):
        super().__init__()
        self.diloco, self.params = diloco, None

    def on_start_training(self, state):
        if self.params is None:
            self.params = [p.detach().clone() for p in state[torchbearer.MODEL].parameters()]
            self.anchor = [a.clone() for a in self.diloco.engine.anchor]


def _resume_from_torchbearers_checkpointer(directory):
    """torchbearer's own MostRecent checkpointer (rank 0 writes its Trial's state) at the first epoch's end, one step
    after the meeting at 9; a new run loads the model and DiLoCo's state from it on every rank (as torchbearer's
    ``Trial.load_state_dict`` does, callback by callback): no rank's own weights in it."""
    import warnings
    options = dict(local_steps=3, overlap_steps=0)
    path = os.path.join(directory, 'torchbearer.pt')
    _trial('mlp', options, extra=[_InterruptAt(11), torchbearer.callbacks.MostRecent(path)])
    dist.barrier()  # rank 0 wrote it
    saved = torch.load(path, weights_only=False)
    listed = saved[torchbearer.CALLBACK_LIST]
    model = _model('mlp', SEED + dist.get_rank())
    model.load_state_dict(saved[torchbearer.MODEL])
    callbacks = distributed_callbacks(**options)
    diloco = next(c for c in callbacks if isinstance(c, DiLoCo))
    diloco.load_state_dict(next(state for kind, state in zip(listed['callback_types'], listed['callback_states'])
                                if kind is DiLoCo))
    at_start = _AtStart(diloco)
    dataset = TensorDataset(*_data())
    trial = torchbearer.Trial(model, torch.optim.SGD(model.parameters(), lr=LR), nn.CrossEntropyLoss(),
                              callbacks=callbacks + [at_start], verbose=0)
    trial.with_train_generator(DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, shuffle=False)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trial.run(EPOCHS)
    return {'messages': [str(w.message) for w in caught if 'local steps after' in str(w.message)],
            'params': at_start.params, 'anchor': at_start.anchor}


class _Anchors(Callback):
    """Records, after every step, whether a meeting is in flight and a copy of the anchor."""

    def __init__(self, diloco):
        super().__init__()
        self.diloco, self.steps = diloco, []

    def on_step_training(self, state):
        engine = self.diloco.engine
        self.steps.append((engine.meeting is not None, [a.clone() for a in engine.anchor]))


def _overlap():
    """H=4, each meeting landing 2 steps after it began while the ranks train on; the paper's outer step."""
    callbacks = distributed_callbacks(local_steps=4, overlap_steps=2, **DiLoCo.PAPER)
    anchors = _Anchors(callbacks[-1])
    torch.manual_seed(0)
    model, _ = _trial('bn', None, optimizer=_momentum_sgd, extra=[anchors], callbacks=callbacks)
    return {'state': _snapshot(model), 'steps': anchors.steps, 'outer_steps': callbacks[-1].engine.steps}


def _overlap_at_the_end():
    """H=5, landing 2 steps later: the meeting that begins at the pass's last step (10) lands there, alone."""
    callbacks = distributed_callbacks(local_steps=5, overlap_steps=2)
    model, _ = _trial('mlp', None, callbacks=callbacks)
    return {'state': _snapshot(model), 'outer_steps': callbacks[-1].engine.steps}


class _Validated(Callback):
    """Records, at each epoch end (after the validation pass), the model validated and DiLoCo's anchor."""

    def __init__(self, diloco):
        super().__init__()
        self.diloco, self.seen = diloco, []

    def on_end_epoch(self, state):
        params = [p.detach().clone() for p in state[torchbearer.MODEL].parameters()]
        self.seen.append((_snapshot(state[torchbearer.MODEL]), params, [a.clone() for a in self.diloco.engine.anchor]))


def _across_epochs():
    """H=4, meetings landing 2 steps late: 2 epochs of 10 steps with a validation between, and 1 epoch of 20."""
    runs = {}
    for epochs, repeats in ((EPOCHS, 1), (1, EPOCHS)):  # the same batches in the same order
        callbacks = distributed_callbacks(local_steps=4, overlap_steps=2, **DiLoCo.PAPER)
        validated = _Validated(callbacks[-1])
        model, _ = _trial('bn-no-dropout', None, optimizer=_momentum_sgd, extra=[validated], callbacks=callbacks,
                          epochs=epochs, repeats=repeats, validation=True)
        runs[epochs] = {'state': _snapshot(model), 'outer_steps': callbacks[-1].engine.steps,
                        'validated': validated.seen}
    return runs


def _momentum_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _worker(directory):
    torch.set_num_threads(1)
    return run_in_step([('equivalence', _equivalence),
                        ('equivalence_int4', functools.partial(_equivalence, compression='int4')),
                        ('equivalence_int8', functools.partial(_equivalence, compression='int8')),
                        ('nesterov_bn', _nesterov_bn), ('stop', _stop),
                        ('second_model', _second_model), ('no_hooks', _no_hooks),
                        ('check_replicas', _check_replicas),
                        ('resume', functools.partial(_resume, directory)), ('overlap', _overlap),
                        ('overlap_end', _overlap_at_the_end),
                        ('resume_overlap', functools.partial(_resume, directory, overlap_steps=2)),
                        ('across_epochs', _across_epochs),
                        ('resume_epoch_end', functools.partial(_resume, directory, every_steps=None, cut=13)),
                        ('resume_foreign', functools.partial(_resume_from_torchbearers_checkpointer, directory))])


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    return run_workers(_worker, 2, args=(str(tmp_path_factory.mktemp('diloco')),), deadline=120)


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), 'entry {} differs: {} vs {}'.format(name, a[name], b[name])


def test_one_local_step_outer_lr_one_no_momentum_is_gradient_averaging(trained):
    rank0, rank1 = scenario_values(trained, 'equivalence')
    assert rank0['steps'] == rank1['steps'] == (EPOCHS * STEPS, EPOCHS * STEPS)
    rank0, rank1 = rank0['state'], rank1['state']
    _assert_equal(rank0, rank1)
    reference = _reference()
    difference = max((rank0[k] - reference[k]).abs().max().item() for k in reference)
    print('DiLoCo(H=1, outer SGD lr 1, no momentum) vs one process at 2B: largest difference {:.2e}'.format(
        difference))
    assert difference < 1e-6
    initial = _snapshot(_model('mlp', SEED))
    assert not torch.equal(reference['0.weight'], initial['0.weight'])  # it did train


def test_one_local_step_in_the_default_int4_wire_is_gradient_averaging_within_its_rounding(trained):
    # DiLoCo(local_steps=1) with every other option at its default (int4) against one process at 2B: each meeting
    # rounds each value to within half a step, 1/(2 x 7) of its block's largest (1/254 in int8); over the run the
    # weights stay within one step's worth of how far they moved (1/7 of it; 1/127), the user's callbacks on both
    # sides of ours see every step, and int8 ends nearer than int4
    reference = _reference()
    initial = _snapshot(_model('mlp', SEED))
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    difference = {}
    for wire_name, levels in (('int4', 7), ('int8', 127)):
        rank0, rank1 = scenario_values(trained, 'equivalence_' + wire_name)
        assert rank0['steps'] == rank1['steps'] == (EPOCHS * STEPS, EPOCHS * STEPS)
        _assert_equal(rank0['state'], rank1['state'])
        difference[wire_name] = max((rank0['state'][k] - reference[k]).abs().max().item() for k in reference)
        assert 1e-6 < difference[wire_name] < moved / levels, (wire_name, difference[wire_name], moved)
    assert difference['int8'] < difference['int4']
    assert DiLoCo().options['compression'] == 'int4'  # what 'the default' is here


def test_replicas_are_bit_identical_after_nesterov_outer_steps_with_batchnorm(trained):
    rank0, rank1 = scenario_values(trained, 'nesterov_bn')
    _assert_equal(rank0['state'], rank1['state'])  # running statistics averaged too
    assert rank0['outer_steps'] == 7  # every 3 steps across the epoch end (3, 6, ..., 18) and the run's end (20)
    assert rank0['state']['1.num_batches_tracked'].item() == EPOCHS * STEPS


def test_the_communication_report_counts_the_outer_steps_traffic(trained):
    rank0, rank1 = scenario_values(trained, 'nesterov_bn')
    model = _model('bn', SEED)
    floating = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    # pseudo-gradients in the default int4 wire: half a byte a value (padded to whole blocks) and a scale a block
    per_outer_step = (wire.wire_bytes(sum(p.numel() for p in model.parameters()), 2, 'int4')
                      + 8 * (floating + 1)  # BatchNorm's statistics and the stop flag, as float64
                      + 8)  # num_batches_tracked, broadcast from rank 0
    # and a stop flag, one float64, at the steps 1, 9, 17, ... of the run
    flags = [sum(1 for step in range(e * STEPS + 1, (e + 1) * STEPS + 1) if (step - 1) % stop_flag.PERIOD == 0)
             for e in range(EPOCHS)]
    meetings = [3, 4]  # steps 3, 6, 9; then 12, 15, 18 and the run's end, 20
    assert rank0['comm_bytes'] == rank1['comm_bytes'] == [m * per_outer_step + 8 * n for m, n in zip(meetings, flags)]
    assert rank0['rates'] == [None] * EPOCHS  # no link rate: how long a meeting travelled while computing is not known


def test_a_stop_on_one_rank_stops_every_rank_at_the_next_step_whatever_h(trained):
    rank0, rank1 = scenario_values(trained, 'stop')
    # a flag every 2 steps here: asked at step 2 on rank 1, posted with the flag of step 3, read when the next is
    # posted, at step 5, and every rank stops after it: before the meeting due at step 8
    assert rank0['trained'] == rank1['trained'] == 5
    _assert_equal(rank0['state'], rank1['state'])  # the end of the pass met: one model


def test_a_second_model_and_optimizer_under_other_keys_are_averaged_too(trained):
    rank0, rank1 = scenario_values(trained, 'second_model')
    _assert_equal(rank0['critic'], rank1['critic'])  # stepped apart on each rank, averaged at each outer step
    assert not torch.equal(rank0['critic']['weight'], rank0['initial'])


def test_an_optimizer_without_step_hooks_is_refused_at_the_start_of_the_run(trained):
    for message in scenario_values(trained, 'no_hooks'):
        assert message == ('state[optimizer] (Wrapper) has no register_step_post_hook, which DiLoCo needs to take its '
                           'outer step after the inner one; pass a torch.optim.Optimizer')


def test_check_replicas_beside_diloco_is_refused_at_the_start_of_the_run(trained):
    for message in scenario_values(trained, 'check_replicas'):  # not a divergence error at its first check
        assert message == ("CheckReplicas(every=3) would compare weights that DiLoCo's ranks hold apart between "
                           "meetings by design; drop CheckReplicas: DiLoCo compares the replicas at every meeting "
                           "(check_divergence=True)")


def test_a_run_resumed_between_two_outer_steps_ends_bit_identical(trained):
    rank0, rank1 = scenario_values(trained, 'resume')
    assert rank0['position']['epoch'] == 0 and rank0['position']['batches'] == 4
    assert rank0['inner_steps'] == 1 and rank0['local'] == 2  # each rank's own weights were in the checkpoint
    assert rank0['dtypes'] == ['torch.float32', 'torch.int64']  # gathered in their own dtypes, not float64
    for rank in (rank0, rank1):
        _assert_equal(rank['resumed'], rank['whole'])
    _assert_equal(rank0['whole'], rank1['whole'])


@pytest.mark.parametrize('make, message', [
    (lambda: DiLoCo(local_steps=0), r'^local_steps should be an integer >= 1, but given 0$'),
    (lambda: DiLoCo(local_steps=True), r'^local_steps should be an integer >= 1, but given True$'),
    (lambda: DiLoCo(local_steps=4, overlap_steps=4),
     r'^overlap_steps should be an integer >= 0 and below local_steps \(4\), but given 4$'),
    (lambda: DiLoCo(overlap_steps=-1), r'^overlap_steps should be an integer >= 0 and below local_steps \(50\), but '
                                       r'given -1$'),
    (lambda: DiLoCo(compression='fp8'), r"^compression should be None, 'fp16', 'bf16', 'int8' or 'int4' \(what "
                                        r"pseudo-gradients travel in\), but given 'fp8'$"),
    (lambda: distributed_callbacks(local_steps=10, compression='powersgd'),
     r"^compression='powersgd' does not combine with local steps: PowerSGD compresses every step's gradients"),
    (lambda: distributed_callbacks(local_steps=10, ddp=True),
     r'^local_steps=10 does not combine with ddp=True: DistributedDataParallel averages gradients at every step; '
     r'pass one of them$'),
])
def test_impossible_combinations_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_distributed_callbacks_with_local_steps_has_diloco_and_no_gradient_averaging():
    callbacks = distributed_callbacks(local_steps=20, outer_lr=0.5, compression='bf16')
    assert isinstance(callbacks[-1], DiLoCo) and callbacks[-1].local_steps == 20
    assert callbacks[-1].options == dict(outer_lr=0.5, outer_momentum=0.0, nesterov=True, compression='bf16')
    assert DiLoCo().options['compression'] == 'int4'  # the default wire
    # meetings land 2 steps after they begin by default; at H=1 they block (the one equivalence)
    assert [DiLoCo(local_steps=h).overlap_steps for h in (1, 2, 3, 50)] == [0, 1, 2, 2]
    assert DiLoCo(local_steps=20).gain == 1.0 and DiLoCo(local_steps=500, **DiLoCo.PAPER).gain == pytest.approx(7.0)
    assert not any(isinstance(c, torchbearer_dist.AllReduceGradients) for c in callbacks)


def test_a_meeting_in_flight_lands_overlap_steps_later_with_the_anchors_bit_identical(trained):
    rank0, rank1 = scenario_values(trained, 'overlap')
    # every 4 steps across the epoch end: meetings begin at steps 4, 8, 12, 16 and 20 and land 2 steps later,
    # the last at once (the run's end blocks)
    assert [flying for flying, _ in rank0['steps']] == [False] * 3 + [True, True, False, False] * 4 + [True]
    for (_, mine), (_, theirs) in zip(rank0['steps'], rank1['steps']):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
    assert not torch.equal(rank0['steps'][4][1][0], rank0['steps'][5][1][0])  # the anchor moved when it landed
    _assert_equal(rank0['state'], rank1['state'])  # the end of the run met, blocking: one model
    assert rank0['outer_steps'] == 5


def test_a_run_resumed_with_a_meeting_in_flight_ends_bit_identical(trained):
    rank0, rank1 = scenario_values(trained, 'resume_overlap')
    assert rank0['position']['batches'] == 4 and rank0['inner_steps'] == 1 and rank0['meeting'] == 1
    for rank in (rank0, rank1):
        _assert_equal(rank['resumed'], rank['whole'])
    _assert_equal(rank0['whole'], rank1['whole'])


def test_a_meeting_that_begins_at_the_last_step_of_a_pass_lands_there_without_another(trained):
    rank0, rank1 = scenario_values(trained, 'overlap_end')
    _assert_equal(rank0['state'], rank1['state'])  # one model at the end of the pass
    assert rank0['outer_steps'] == EPOCHS * 2  # steps 5 (landing at 7) and 10, no third meeting at the end


def test_meetings_go_every_h_steps_across_epoch_ends_which_change_nothing_in_training(trained):
    for rank in scenario_values(trained, 'across_epochs'):
        # two epochs with a validation between end bit-identical to one epoch of the same 20 batches
        _assert_equal(rank[EPOCHS]['state'], rank[1]['state'])
        assert rank[EPOCHS]['outer_steps'] == rank[1]['outer_steps'] == 5  # landing at 6, 10, 14, 18; 20


def test_validation_between_two_meetings_sees_the_anchor_every_rank_holds(trained):
    rank0, rank1 = scenario_values(trained, 'across_epochs')
    (model0, params0, anchor0), (model1, _, _) = rank0[EPOCHS]['validated'][0], rank1[EPOCHS]['validated'][0]
    for p, a in zip(params0, anchor0):  # the first epoch ends 2 steps after a meeting: the anchor shows
        assert torch.equal(p, a)
    _assert_equal(model0, model1)  # the BatchNorm statistics as of that meeting too
    assert not torch.equal(params0[0], rank0[EPOCHS]['validated'][1][1][0])


def test_a_run_resumed_from_an_epoch_end_checkpoint_between_two_meetings_ends_bit_identical(trained):
    rank0, rank1 = scenario_values(trained, 'resume_epoch_end')
    assert rank0['position'] is None  # an epoch-end checkpoint
    assert rank0['inner_steps'] == 1 and rank0['local'] == 2  # 1 step after the meeting at 9: every rank's own state
    for rank in (rank0, rank1):
        _assert_equal(rank['resumed'], rank['whole'])
    _assert_equal(rank0['whole'], rank1['whole'])


def test_a_run_resumed_from_torchbearers_own_checkpointer_starts_every_rank_from_the_anchor_and_says_why(trained):
    rank0, rank1 = scenario_values(trained, 'resume_foreign')
    assert rank0['messages'] == [
        "the checkpoint was written 1 local steps after an outer step and holds no rank's own weights (its "
        "checkpointer saved one process's state; torchbearer_dist.Checkpoint gathers every rank's): every rank "
        "starts again from the anchor"]
    assert rank1['messages'] == []  # rank 0 says it, once
    for rank in (rank0, rank1):
        for p, anchor, other in zip(rank['params'], rank['anchor'], rank0['anchor']):
            assert torch.equal(p, anchor) and torch.equal(anchor, other)  # one anchor, every rank's weights on it
