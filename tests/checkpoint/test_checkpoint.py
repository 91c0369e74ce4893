"""Checkpoints (issue 4, item 9; issue 8, item 8): rank 0 alone touches the path, writes atomically; resume on
another world size restores callbacks and schedulers too.

The crash test runs this file as a script (``python tests/checkpoint/test_checkpoint.py --write PATH``): a writer
saving checkpoints in a loop, killed with SIGKILL at random moments.
"""
import argparse
import functools
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial
from torchbearer.callbacks import EarlyStopping, StepLR
from torchbearer.callbacks.torch_scheduler import TorchScheduler

import torchbearer_dist as tbd
from torchbearer_dist.checkpoint import files

# tests/, for the shared helpers: pytest's conftest puts it on sys.path, but not a script run of this
# file, nor the ranks that launch() spawns from one (they import it as __mp_main__).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ != '__main__':
    from _dist import ROOT, child_env, kill_session, run_workers

HERE = os.path.abspath(__file__)


class _Epochs(Callback):
    """Record the global epochs this Trial ran."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_start_epoch(self, state):
        self.seen.append(state[torchbearer.EPOCH])


def _trial(path):
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randint(0, 3, (96,))
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, tbd.get_world_size(), tbd.get_rank(),
                                                                        seed=0))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # has state worth restoring
    epochs = _Epochs()
    callbacks = [epochs, tbd.Checkpoint(path), *tbd.distributed_callbacks()]
    trial = Trial(model, optimizer, torch.nn.functional.cross_entropy, metrics=['loss'], callbacks=callbacks,
                  verbose=0).with_generators(loader)
    return trial, epochs


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _worker_train(path, epochs, resume):
    """Train to ``epochs`` (resuming from ``path`` when asked); count this rank's checkpoint writes."""
    writes = []
    real = files._write
    files._write = lambda payload, target: (writes.append(target), real(payload, target))
    trial, seen = _trial(path)
    loaded = None
    if resume:
        files.load_checkpoint(path, trial=trial)
        loaded = _params(trial.state[torchbearer.MODEL])
    trial.run(epochs)
    return dict(writes=len(writes), epochs=seen.seen, params=_params(trial.state[torchbearer.MODEL]), loaded=loaded,
                history=len(trial.state[torchbearer.HISTORY]))


@pytest.mark.slow
def test_rank_0_writes_and_a_smaller_job_resumes(tmp_path):
    path = str(tmp_path / 'run.pt')
    results = run_workers(_worker_train, 2, args=(path, 2, False))
    assert [r['writes'] for r in results] == [2, 0]
    torch.testing.assert_close(results[0]['params'], results[1]['params'], rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == ['run.pt']

    saved = torch.load(path, weights_only=True)
    assert saved['world_size'] == 2 and len(saved['history']) == 2
    resumed = _worker_train(path, 3, True)  # world size 1, no process group
    assert resumed['history'] == 3 and resumed['epochs'] == [2]
    torch.testing.assert_close(resumed['loaded'], results[0]['params'], rtol=0, atol=0)
    assert len(torch.load(path, weights_only=True)['history']) == 3


@pytest.mark.slow
def test_a_larger_job_resumes_at_the_saved_epoch(tmp_path):
    path = str(tmp_path / 'run.pt')
    alone = _worker_train(path, 1, False)
    assert alone['writes'] == 1
    results = run_workers(_worker_train, 2, args=(path, 3, True))
    for result in results:
        assert result['epochs'] == [1, 2] and result['history'] == 3
        torch.testing.assert_close(result['loaded'], alone['params'], rtol=0, atol=0)
    assert [r['writes'] for r in results] == [2, 0]
    torch.testing.assert_close(results[0]['params'], results[1]['params'], rtol=0, atol=0)
    assert torch.load(path, weights_only=True)['optimizer']['state'], 'Adam state lost'


def test_optimizer_state_and_history_round_trip(tmp_path):
    path = str(tmp_path / 'run.pt')
    trial, _ = _trial(path)
    trial.run(1)
    fresh, _ = _trial(path)
    tbd.load_checkpoint(path, trial=fresh)
    optimizer = fresh.state[torchbearer.OPTIMIZER].state_dict()
    expected = trial.state[torchbearer.OPTIMIZER].state_dict()
    torch.testing.assert_close(optimizer['state'], expected['state'], rtol=0, atol=0)
    assert len(fresh.state[torchbearer.HISTORY]) == 1


def test_bad_arguments_and_files(tmp_path):
    with pytest.raises(ValueError, match=r'^every should be an integer >= 1, but given 0$'):
        tbd.Checkpoint(str(tmp_path / 'a.pt'), every=0)
    with pytest.raises(ValueError, match=r"^no checkpoint at '.*missing\.pt' on rank 0; pass the path given to "):
        tbd.load_checkpoint(str(tmp_path / 'missing.pt'))
    with pytest.raises(ValueError, match=r"^the directory of the checkpoint path '.*' does not exist"):
        tbd.save_checkpoint(str(tmp_path / 'no' / 'a.pt'), torch.nn.Linear(1, 1))
    torch.save({'model': {}}, str(tmp_path / 'other.pt'))
    with pytest.raises(RuntimeError, match=r'is not a torchbearer_dist checkpoint'):
        tbd.load_checkpoint(str(tmp_path / 'other.pt'))


class _Payload:
    """Runs code when unpickled: what a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def test_a_checkpoint_carrying_code_is_refused(tmp_path):
    marker = str(tmp_path / 'pwned')
    path = str(tmp_path / 'evil.pt')
    torch.save({'format': files.FORMAT, 'model': _Payload(marker)}, path)
    with pytest.raises(RuntimeError, match=r"^checkpoint '.*evil\.pt' holds objects other than tensors and plain "
                                           r"values, which weights_only loading refuses"):
        tbd.load_checkpoint(path, model=torch.nn.Linear(1, 1))
    assert not os.path.exists(marker)


def _writer(path):
    """Save checkpoints in a loop, each a consistent version: every tensor filled with its number."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # about 2 MB
    version = int(torch.load(path, weights_only=True)['history'][-1]['version']) if os.path.exists(path) else 0
    print('writing', flush=True)
    while True:
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(version)
        tbd.save_checkpoint(path, model, history=[{'version': version}])


def _check_consistent(path):
    saved = tbd.load_checkpoint(path)  # weights_only=True inside
    version = saved['history'][-1]['version']
    for name, tensor in saved['model'].items():
        assert torch.all(tensor == version), 'torn checkpoint: {} is not all {}'.format(name, version)
    return version


def test_killing_the_writer_always_leaves_a_loadable_checkpoint(tmp_path):
    path = str(tmp_path / 'run.pt')
    rng = random.Random(0)
    versions = []
    for _ in range(5):
        process = subprocess.Popen([sys.executable, HERE, '--write', path], stdout=subprocess.PIPE,
                                   start_new_session=True, env=child_env(), cwd=ROOT)
        try:
            assert process.stdout.readline() == b'writing\n'
            time.sleep(rng.uniform(0.05, 1.0))
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            kill_session(process.pid)
            process.wait()
            process.stdout.close()
        if os.path.exists(path):
            versions.append(_check_consistent(path))
    print('versions at each kill:', versions)
    assert len(versions) >= 4 and versions == sorted(versions) and versions[-1] > versions[0]
    leftovers = [name for name in os.listdir(tmp_path) if name != 'run.pt']
    assert len(leftovers) <= 1, leftovers  # at most the temporary of the last killed writer


def _resumable(path, callbacks_before=True):
    """A Trial whose callbacks keep state: EarlyStopping's counters, a StepLR and a ReduceLROnPlateau."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, tbd.get_world_size(), tbd.get_rank(), shuffle=True, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    # torchbearer 0.5.5's own ReduceLROnPlateau passes verbose=, which torch 2.14 rejects: build it directly.
    # mode='max' on a falling loss: every epoch counts as bad, so the counters move every epoch.
    plateau = TorchScheduler(functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode='max', factor=0.8,
                                               patience=1), monitor='loss')
    stateful = [EarlyStopping(monitor='loss', mode='max', patience=100), StepLR(step_size=2, gamma=0.5), plateau]
    ours = [tbd.Checkpoint(path), *tbd.distributed_callbacks()]
    callbacks = stateful + ours if callbacks_before else ours + stateful
    trial = Trial(model, optimizer, torch.nn.functional.cross_entropy, metrics=['loss'], callbacks=callbacks,
                  verbose=0)
    return trial.with_generators(DataLoader(data, batch_size=8, sampler=sampler)), stateful


def _end_state(trial, stateful):
    early, step, plateau = stateful
    return dict(params=_params(trial.state[torchbearer.MODEL]),
                lr=[g['lr'] for g in trial.state[torchbearer.OPTIMIZER].param_groups],
                early=(early.wait, float(early.best)),
                step={k: step._scheduler.state_dict()[k] for k in ('last_epoch', 'base_lrs', '_last_lr')},
                plateau={k: plateau._scheduler.state_dict()[k] for k in ('last_epoch', 'best', 'num_bad_epochs',
                                                                           '_last_lr')})


def _resume_in_two(directory, epochs, split):
    """Train ``epochs`` straight through, and ``split`` then resume to ``epochs`` in a fresh Trial."""
    straight = _resumable(os.path.join(directory, 'straight.pt'))
    straight[0].run(epochs)
    path = os.path.join(directory, 'split.pt')
    first = _resumable(path)
    first[0].run(split)
    second = _resumable(path, callbacks_before=True)
    tbd.load_checkpoint(path, trial=second[0])
    second[0].run(epochs)
    return _end_state(*straight), _end_state(*second)


def test_resume_restores_callbacks_and_schedulers(tmp_path):
    straight, resumed = _resume_in_two(str(tmp_path), 5, 2)
    assert straight['lr'] != [0.5]  # the schedulers did act
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def _worker_rank_0_only(root):
    """Each rank in its own directory: a relative path exists on rank 0's "machine" only."""
    rank = tbd.get_rank()
    os.chdir(os.path.join(root, 'rank{}'.format(rank)))
    results = {}
    trial, stateful = _resumable(os.path.join('ckpt', 'run.pt'))
    trial.run(2)
    fresh, fresh_stateful = _resumable(os.path.join('ckpt', 'run.pt'))
    tbd.load_checkpoint(os.path.join('ckpt', 'run.pt'), trial=fresh)
    results['loaded'] = _params(fresh.state[torchbearer.MODEL])
    results['trained'] = _params(trial.state[torchbearer.MODEL])
    fresh.run(3)
    results['resumed'] = _end_state(fresh, fresh_stateful)
    missing, _ = _resumable(os.path.join('nowhere', 'run.pt'))
    try:
        missing.run(1)
    except ValueError as error:
        results['missing'] = str(error)
    return results


@pytest.mark.slow
def test_only_rank_0_touches_the_path(tmp_path):
    for rank in (0, 1):
        (tmp_path / 'rank{}'.format(rank)).mkdir()
    (tmp_path / 'rank0' / 'ckpt').mkdir()
    results = run_workers(_worker_rank_0_only, 2, args=(str(tmp_path),))
    assert os.listdir(tmp_path / 'rank1') == []
    assert sorted(os.listdir(tmp_path / 'rank0' / 'ckpt')) == ['run.pt']
    for result in results:
        torch.testing.assert_close(result['loaded'], results[0]['trained'], rtol=0, atol=0)
        assert result['missing'] == ("the directory of the checkpoint path 'nowhere/run.pt' does not exist on rank 0; "
                                     "create it there first")
    torch.testing.assert_close(results[1]['resumed'], results[0]['resumed'], rtol=0, atol=0)


def test_stale_temporaries_are_judged_by_host_and_start_time(tmp_path):
    from torchbearer_dist.checkpoint import _atomic
    path = str(tmp_path / 'run.pt')
    host = _atomic._host()
    mine = _atomic._temporary(path)
    dead = '{}.tmp.{}.{}.{}'.format(path, host, os.getpid(), 1)  # this pid, another start time: reused id
    elsewhere = '{}.tmp.{}.{}.{}'.format(path, _atomic._host().rsplit('-', 1)[0] + '-otherboot', 1, 1)
    for name in (mine, dead, elsewhere):
        open(name, 'w').close()
    _atomic.remove_stale_temporaries(path)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n) for n in (mine, elsewhere))


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--write', type=str, required=True)
    torch.set_num_threads(1)
    _writer(parser.parse_args().write)
