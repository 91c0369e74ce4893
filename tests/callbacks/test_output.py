"""Only rank 0 prints and writes; every rank carries on with the same model."""
import io
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
import torch.distributed as dist
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial
from torchbearer.callbacks import Best, ConsolePrinter, CSVLogger, MostRecent

import torchbearer_dist
from torchbearer_dist import RankZeroOnly

from _dist import run_workers


class _Say(Callback):
    """A custom printer."""

    def __init__(self, word):
        super().__init__()
        self.word = word

    def on_end_epoch(self, state):
        print('{} says epoch {}'.format(self.word, state[torchbearer.EPOCH]))


def _data():
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _worker_output(directory):
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def path(name):
        return os.path.join(directory, 'rank{}_{}'.format(rank, name))

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        torch.manual_seed(rank)
        model = nn.Linear(4, 1)
        callbacks = [MostRecent(path('recent.pt')), Best(path('best.pt'), monitor='loss'), CSVLogger(path('log.csv')),
                     ConsolePrinter(), RankZeroOnly(_Say('wrapped')), *torchbearer_dist.distributed_callbacks()]
        trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), metrics=['loss'],
                      callbacks=callbacks, verbose=2)
        trial.with_train_generator(_data())
        trial.run(2)  # the Trial's own progress bar, per batch
        history = trial.run(3, verbose=1)  # a progress bar injected by run, per epoch
        trial.evaluate(verbose=2, data_key=torchbearer.TRAIN_DATA)
        trial.predict(2, data_key=torchbearer.TRAIN_DATA)
        # RankZeroOnly on its own, without RankZeroOutput
        alone = Trial(nn.Linear(4, 1), callbacks=[RankZeroOnly(_Say('alone'))], verbose=0)
        alone.with_train_generator(_data()).run(1)
    return {'out': out.getvalue(), 'err': err.getvalue(), 'history': history,
            'params': {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope='module')
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp('output'))


@pytest.fixture(scope='module')
def outputs(directory):
    return run_workers(_worker_output, 2, args=(directory,))


def visible(text):
    """What a terminal shows of ``text``: each line's last carriage-return overwrite, blank lines dropped."""
    return [line.rsplit('\r', 1)[-1].rstrip() for line in text.split('\n') if line.rsplit('\r', 1)[-1].strip()]


@pytest.mark.slow
def test_only_rank_zero_prints(outputs):
    rank0, rank1 = outputs
    assert rank1['out'] == '' and visible(rank1['err']) == []
    # The one thing rank 1 wrote: the per-epoch bar of run(3, verbose=1), which torchbearer starts (at
    # 2/3, then 3/3 with the last epoch's global metrics) before any callback's on_start; it was erased
    # there. No per-batch bar of run, evaluate or predict started.
    assert '3/3' in rank1['err'] and not any(letter in rank1['err'] for letter in ('(t)', '(e)', '(p)'))
    assert '1/2(t)' in rank0['err'] and '(e)' in rank0['err'] and '(p)' in rank0['err']  # run, evaluate, predict
    assert 'wrapped says epoch 2' in rank0['out'] and 'alone says epoch 0' in rank0['out']
    assert 'running_loss' in rank0['out']  # ConsolePrinter


@pytest.mark.slow
def test_only_rank_zero_writes(outputs, directory):
    assert sorted(os.listdir(directory)) == ['rank0_best.pt', 'rank0_log.csv', 'rank0_recent.pt']
    with open(os.path.join(directory, 'rank0_log.csv')) as f:
        lines = f.read().splitlines()
    # evaluate and predict start a new log, as torchbearer does: predict's one row of epoch 0 is left
    assert len(lines) == 1 and lines[0].split(',')[0] == '0', lines
    saved = torch.load(os.path.join(directory, 'rank0_recent.pt'), weights_only=False)
    assert len(saved['history']) == 3


@pytest.mark.slow
def test_every_rank_carries_on(outputs):
    rank0, rank1 = outputs
    assert len(rank0['history']) == len(rank1['history']) == 3
    for name in rank0['params']:
        assert torch.equal(rank0['params'][name], rank1['params'][name])


def test_rank_zero_only_runs_the_callback_outside_a_process_group(capsys):
    trial = Trial(nn.Linear(4, 1), callbacks=[RankZeroOnly(_Say('single'))], verbose=0)
    trial.with_train_generator(DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2)).run(1)
    assert 'single says epoch 0' in capsys.readouterr().out
