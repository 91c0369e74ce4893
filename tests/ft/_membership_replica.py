"""One replica of tests/ft/test_membership_semantics.py: a small float64 Trial whose every step goes through torchft.

Replica ``r`` trains its own shard of :func:`dataset`, in order: :data:`TRAIN` ``[r]`` training samples and
:data:`VAL` ``[r]`` validation ones. Every replica takes the same number of steps, but the last batches differ
in size, and the labels are noisier on some shards than on others, so that the replicas' figures differ.

Its callbacks: :class:`Local` before ours (each pass's figures before they are averaged over the replicas, as
``LOCAL <json>`` lines; with ``--die-at EPOCH BATCH`` this process SIGKILLs itself inside that step, after its
forward pass, while the others wait in the all-reduce for its gradients; with ``--hold-at EPOCH BATCH FILE``
it waits before that step until a joining replica, started with ``--announce FILE``, asks for its first quorum),
:class:`~torchbearer_dist.FaultTolerantAllReduce`, then :class:`Steps` after ours (each step's weights and
optimizer state before and after it, its quorum's size and whether torchft committed it; saved to ``--record``,
also where the run fails). Prints ``DONE <history json>`` at the end; an error ends it with one line on stderr,
``ELAPSED <s>`` (seconds since ``run()`` began) on stdout and status 1.

``TBD_MUTANT=<name>`` breaks the package on purpose in this process (:data:`MUTANTS`, by monkeypatching);
tests/scripts/ft_semantics_mutants.py checks that each one fails its test.
"""
import argparse
import copy
import json
import os
import signal
import sys
import time

import torch
import torchbearer
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist as tbd

BATCH, LR, MOMENTUM = 4, 0.1, 0.9
#: Seconds a held replica waits after a joining one announced its first quorum (see _hold).
HOLD = 2.0
#: Each replica's samples: 6 training steps each, the last one of 4, 1 and 2 samples; 2, 1 and 2 validation steps.
TRAIN, VAL = (24, 21, 22), (8, 3, 5)
#: How far each shard's labels are from the rule the model can learn (its figures differ from the others').
NOISE = (0.0, 2.0, 1.0)
FEATURES, CLASSES = 6, 3


def dataset():
    """Every replica's data: the training shards one after the other, then the validation shards."""
    sizes = TRAIN + VAL
    x = torch.randn(sum(sizes), FEATURES, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = torch.randn(sum(sizes), CLASSES, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = torch.cat([torch.full((n, 1), NOISE[i % len(TRAIN)], dtype=torch.float64) for i, n in enumerate(sizes)])
    return TensorDataset(x, (x[:, :CLASSES] + scale * noise).argmax(1))


def shard(replica, kind='train'):
    """The indices of ``replica``'s shard of :func:`dataset`, in the order it trains (or validates) them."""
    start = sum(TRAIN[:replica]) if kind == 'train' else sum(TRAIN) + sum(VAL[:replica])
    return list(range(start, start + (TRAIN if kind == 'train' else VAL)[replica]))


def batch(data, replica, k):
    """``replica``'s ``k``-th training batch: inputs and targets."""
    return data[shard(replica)[k * BATCH:(k + 1) * BATCH]]


def model(replica):
    torch.manual_seed(100 + replica)  # different initial weights: the first step's init_sync aligns them
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES)).double()


def optimizer(net):
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


class Local(Callback):
    """Before ours: the time ``run()`` began, each pass's own figures and samples (the per-sample means of its
    batches' loss and of its correct predictions: what the replicas' figures are reduced from),
    and the kill inside step ``die_at`` (after the forward pass, ``delay`` s later, when the others wait for this
    one)."""

    def __init__(self, die_at=None, delay=1.5, hold_at=None):
        super().__init__()
        self.die_at, self.delay, self.began, self.samples, self.sums = die_at, delay, None, 0, [0.0, 0.0]
        self.hold_at = hold_at

    def on_sample(self, state):
        at = [str(state[torchbearer.EPOCH]), str(state[torchbearer.BATCH])]
        if self.hold_at is not None and self.hold_at[:2] == at:
            _hold(self.hold_at[2])  # before this step asks for its quorum
        self._count(state)

    def on_start(self, state):
        self.began = time.monotonic()

    def on_start_training(self, state):
        self.samples, self.sums = 0, [0.0, 0.0]

    on_start_validation = on_start_training

    def _count(self, state):
        self.samples += state[torchbearer.Y_TRUE].size(0)

    on_sample_validation = _count

    def on_criterion(self, state):
        if self.die_at == [state[torchbearer.EPOCH], state[torchbearer.BATCH]]:
            print('DYING', flush=True)
            time.sleep(self.delay)
            os.kill(os.getpid(), signal.SIGKILL)
        self._add(state)

    def on_criterion_validation(self, state):
        self._add(state)

    def _add(self, state):
        y = state[torchbearer.Y_TRUE]
        self.sums[0] += float(state[torchbearer.LOSS].detach()) * y.size(0)
        self.sums[1] += int((state[torchbearer.Y_PRED].argmax(1) == y).sum())

    def _report(self, state, kind):
        prefix = '' if kind == 'train' else 'val_'
        figures = {prefix + 'loss': self.sums[0] / self.samples, prefix + 'acc': self.sums[1] / self.samples}
        print('LOCAL', json.dumps({'epoch': state[torchbearer.EPOCH], 'pass': kind, 'samples': self.samples,
                                   'metrics': figures}, sort_keys=True), flush=True)

    def on_end_training(self, state):
        self._report(state, 'train')

    def on_end_validation(self, state):
        self._report(state, 'val')


def _snapshot(state):
    return copy.deepcopy({'model': state[torchbearer.MODEL].state_dict(),
                          'optimizer': state[torchbearer.OPTIMIZER].state_dict()})


class Steps(Callback):
    """After ours: each step's batch, its quorum's size, the weights and optimizer state after the quorum and after
    the step, and whether torchft committed the step (its step count went up)."""

    def __init__(self, ft):
        super().__init__()
        self.ft, self.steps, self.current = ft, [], None

    def on_sample(self, state):
        manager = self.ft.replica.manager
        self.current = {'epoch': state[torchbearer.EPOCH], 'batch': state[torchbearer.BATCH],
                        'x': state[torchbearer.X].clone(), 'y': state[torchbearer.Y_TRUE].clone(),
                        'participants': manager.num_participants(), 'step': manager.current_step(),
                        'before': _snapshot(state)}

    def on_step_training(self, state):
        committed = self.ft.replica.manager.current_step() > self.current['step']
        self.current.update(after=_snapshot(state), committed=committed)
        self.steps.append(self.current)


def _before_first_quorum(action):
    """``action()`` once, in this process, just before its replica asks for its first quorum."""
    from torchbearer_dist.ft.replica import Replica
    original = Replica.start_quorum

    def start_quorum(self, *args, **kwargs):
        Replica.start_quorum = original
        action()
        return original(self, *args, **kwargs)
    Replica.start_quorum = start_quorum


def _first_quorum_together(folder, replica, replicas):
    """The first quorum of every replica waits until all ``replicas`` have their Manager up, and a second more
    (every Manager heartbeats every 0.1 s): the lighthouse then waits for all of them (its join timeout), so
    that the first quorum holds them all, in whatever order their processes started. A test harness, not a
    mutant."""
    def wait():
        open(os.path.join(folder, 'up-{}'.format(replica)), 'w').close()
        end = time.monotonic() + 120
        while len([n for n in os.listdir(folder) if n.startswith('up-')]) < replicas and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(1.0)
    _before_first_quorum(wait)


def _hold(announced):
    """Until the file ``announced`` exists (a joining replica asks for its first quorum), then HOLD seconds more, so
    that its request is at the lighthouse before this replica's: the quorum this step asks for then holds it."""
    open(announced + '.held-{}'.format(os.getpid()), 'w').close()
    end = time.monotonic() + 120
    while not os.path.exists(announced) and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(HOLD)


class _Then:
    """A torchft Work whose ``wait()`` then runs ``then()``."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, timeout=None):
        done = self.work.wait()
        self.then()
        return done


def _configured_count(replicas):
    """The gradients averaged over the configured replicas, not the live ones: AVG as a SUM divided by N."""
    from torchbearer_dist.sync import group
    original = group.QuorumGroup.all_reduce

    def all_reduce(self, tensor, op=group.SUM):
        if op != group.AVG:
            return original(self, tensor, op)
        return _Then(original(self, tensor, group.SUM), lambda: tensor.div_(replicas))
    group.QuorumGroup.all_reduce = all_reduce


def _unweighted_metrics(replicas):
    """The figures averaged with each batch weighing the same, whatever its samples (a replica's shard)."""
    tbd.ReduceMetrics._weight = lambda self, n: min(n, 1)


def _step_uncommitted(replicas):
    """The optimizers step whatever torchft decided: its verdict is asked for, then ignored."""
    import torchft
    original = torchft.Manager.should_commit

    def should_commit(self, timeout=None):
        original(self, timeout)
        return True
    torchft.Manager.should_commit = should_commit


def _quorum_wait(replicas):
    """A quorum waits one timeout, where the message says three: every quorum's wait capped at the Manager's
    ``timeout`` (the package passes each quorum's own, so the Manager's ``quorum_timeout`` is never read)."""
    import torchft
    init, start = torchft.Manager.__init__, torchft.Manager.start_quorum

    def __init__(self, *args, **kwargs):
        self.mutant_timeout = kwargs['timeout']
        init(self, *args, **kwargs)

    def start_quorum(self, allow_heal=True, shrink_only=False, timeout=None):
        return start(self, allow_heal, shrink_only, min(timeout or self.mutant_timeout, self.mutant_timeout))
    torchft.Manager.__init__, torchft.Manager.start_quorum = __init__, start_quorum


def _synchronous_quorum(replicas):
    """The steps' quorum taken at once (torchft's synchronous quorum): a replica that joins counts in its first
    step, with the gradient of weights it held before it healed."""
    from torchbearer_dist.ft import replica
    original = replica.Replica.__init__

    def __init__(self, *args, **kwargs):
        kwargs['deferred'] = False
        original(self, *args, **kwargs)
    replica.Replica.__init__ = __init__


def _unreported_failure(replicas):
    """A sum that failed on the process group (a replica lost during it) is not recorded with the Manager: torchft
    commits the step whose gradients hold only part of the replicas' sum."""
    from torchbearer_dist.sync import group
    original = group._QuorumWork.wait

    def wait(self):
        self.manager.report_error = lambda error: None  # this wait's failure goes nowhere
        try:
            return original(self)
        finally:
            del self.manager.report_error
    group._QuorumWork.wait = wait


#: ``TBD_MUTANT`` names: the bug each one plants.
MUTANTS = {'configured_count': _configured_count, 'unweighted_metrics': _unweighted_metrics,
           'step_uncommitted': _step_uncommitted, 'quorum_wait': _quorum_wait,
           'synchronous_quorum': _synchronous_quorum, 'unreported_failure': _unreported_failure}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--lighthouse', type=str, required=True)
    parser.add_argument('--replica', type=int, required=True)
    parser.add_argument('--replicas', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--timeout', type=float, default=10.0)
    parser.add_argument('--min-replicas', type=int, default=1)
    parser.add_argument('--record', type=str, help='save every step (Steps) here (torch.save)')
    parser.add_argument('--die-at', type=int, nargs=2, metavar=('EPOCH', 'BATCH'), help='SIGKILL inside that step')
    parser.add_argument('--barrier', type=str, help='a folder: the first quorum waits for every replica there')
    parser.add_argument('--hold-at', type=str, nargs=3, metavar=('EPOCH', 'BATCH', 'FILE'),
                        help='before that step asks for its quorum, wait until FILE exists, and HOLD s more')
    parser.add_argument('--announce', type=str, help='make this file, then ask for the first quorum')
    args = parser.parse_args()
    mutant = os.environ.get('TBD_MUTANT')
    if mutant:
        MUTANTS[mutant](args.replicas)
    if args.barrier:
        _first_quorum_together(args.barrier, args.replica, args.replicas)
    if args.announce:  # the file made, then the first quorum asked for (see _hold)
        _before_first_quorum(lambda: open(args.announce, 'w').close())
    torch.set_num_threads(1)
    data = dataset()
    net = model(args.replica)
    ft = tbd.FaultTolerantAllReduce(args.lighthouse, replica_id='r{}'.format(args.replica), timeout=args.timeout,
                                    min_replicas=args.min_replicas)
    local, steps = Local(args.die_at, hold_at=args.hold_at), Steps(ft)
    trial = Trial(net, optimizer(net), torch.nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[local, ft, tbd.ReduceMetrics(group=ft.group), steps])
    trial.to(torch.float64)  # torchbearer casts each batch to its dtype
    trial.with_generators(DataLoader(data, batch_size=BATCH, sampler=shard(args.replica)),
                          val_generator=DataLoader(data, batch_size=BATCH, sampler=shard(args.replica, 'val')))
    print('READY', flush=True)
    try:
        history = trial.run(args.epochs, verbose=0)
    except (RuntimeError, ValueError):
        print('ELAPSED', time.monotonic() - local.began, flush=True)
        raise
    finally:  # also where the run fails: the steps it took are what a test checks first
        if args.record:
            torch.save(steps.steps, args.record)
    print('DONE', json.dumps(history, sort_keys=True), flush=True)


if __name__ == '__main__':
    try:
        main()
    except (RuntimeError, ValueError) as e:
        print('error: {}'.format(e), file=sys.stderr, flush=True)
        sys.exit(1)
