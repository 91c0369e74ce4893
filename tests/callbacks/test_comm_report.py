"""CommunicationReport: each epoch rank 0 prints once; the history holds bytes, waits, link rate, the slowest rank.

"Bytes sent" is the payload each rank hands to all-reduce: every gradient value in its wire dtype,
one presence flag per parameter and the last bucket's control slots (the stop flag) per step. The
tests count it from the model (parameters' sizes, the number of steps), not from the engine's buffers.
"""
import io
import json
import os
import re
import runpy
import time
from contextlib import redirect_stdout

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist
from torchbearer_dist.callbacks.comm_report import (
    COMM_BYTES,
    COMM_RATE,
    COMM_WAIT,
    REPORT_KEYS,
    SLOWEST_LAG,
    SLOWEST_RANK,
    TRAIN_TIME,
    CommunicationReport,
)
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import FlatBucket

from _dist import ROOT, python, run_command, run_in_step, run_workers, scenario_values, world_of_one

BATCHES = 8  # per rank and epoch
EPOCHS = 2
SLEEP = 0.05  # seconds rank 1 sleeps per step in the slow-rank scenario
END_OF_PASS = 1.0  # seconds of a callback's on_end_training after the report's; 8 tiny steps take far less
LINE = re.compile(r'^communication, epoch (\d+)/(\d+): (.*)$', re.M)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(BATCHES * 4, 32, generator=generator), torch.randn(BATCHES * 4, 4, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


class _Sleep(Callback):
    """Rank 1 computes ``SLEEP`` seconds longer at every step."""

    def on_sample(self, state):
        if dist.get_rank() == 1:
            time.sleep(SLEEP)


class _EndOfPass(Callback):
    """After the report in the list: end-of-pass work of ``END_OF_PASS`` seconds (as DiLoCo's last meeting)."""

    def on_end_training(self, state):
        time.sleep(END_OF_PASS)


def _run(extra=(), after=(), verbose=1, **options):
    """Two epochs; ``verbose=1`` shows progress (its bar goes to stderr, the report's line to stdout)."""
    model = _model()
    callbacks = [*extra, *torchbearer_dist.distributed_callbacks(**options), *after]
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), metrics=['loss'],
                  callbacks=callbacks, verbose=verbose).with_train_generator(_data())
    out = io.StringIO()
    with redirect_stdout(out):
        history = trial.run(EPOCHS)
    return {'history': history, 'out': out.getvalue()}


SCENARIOS = {
    'default': lambda: _run(),
    'overlapped': lambda: _run(overlap=True, bucket_cap_mb=0.001, first_bucket_mb=0.0005),
    'fp16': lambda: _run(compression='fp16'),
    'powersgd': lambda: _run(compression='powersgd', powersgd_rank=1, powersgd_start_iter=2),
    'off': lambda: _run(report=False),
    'slow_rank': lambda: _run(extra=[_Sleep()]),
    'quiet': lambda: _run(verbose=0),
    'end_of_pass': lambda: _run(after=[_EndOfPass()]),
}


def _worker():
    torch.set_num_threads(1)
    return run_in_step((name, SCENARIOS[name]) for name in SCENARIOS)


@pytest.fixture(scope='module')
def ranks():
    return run_workers(_worker, 2, deadline=90)


def _params():
    return list(_model().parameters())


#: The last bucket's control slots after the presence flags: the stop flag (and any other signal the engine carries).
CONTROL = FlatBucket([nn.Parameter(torch.zeros(1))], last=True).flat.numel() - 2


def _plain_bytes(element_size=4, control=CONTROL):
    """Payload per step: every gradient value, one flag per parameter, the control slots."""
    params = _params()
    return (sum(p.numel() for p in params) + len(params) + control) * element_size


def _powersgd_bytes():
    """Per compressed step at rank 1: the vectors, P (n x 1) and Q (m x 1) of each matrix, the flags and stop flag."""
    params = _params()
    dense = sum(p.numel() for p in params if p.dim() < 2)
    factors = sum(p.shape[0] + p.shape[1] for p in params if p.dim() >= 2)
    return (dense + factors + len(params) + 1) * 4


@pytest.mark.slow
@pytest.mark.parametrize('name, per_epoch', [
    ('default', lambda: BATCHES * _plain_bytes()),
    ('overlapped', lambda: BATCHES * _plain_bytes()),
    ('fp16', lambda: BATCHES * _plain_bytes(2)),
    # PowerSGD averages the first 2 steps uncompressed (values, flags and a stop flag), then sends factors
    ('powersgd', None),
])
def test_the_history_holds_the_bytes_each_rank_handed_to_all_reduce(ranks, name, per_epoch):
    rank0, rank1 = scenario_values(ranks, name)
    assert rank0['history'] == rank1['history']  # the same figures on every rank
    expected = [per_epoch()] * EPOCHS if per_epoch else [
        2 * _plain_bytes(control=1) + (BATCHES - 2) * _powersgd_bytes(), BATCHES * _powersgd_bytes()]
    assert [entry[COMM_BYTES] for entry in rank0['history']] == expected
    for entry in rank0['history']:
        assert set(REPORT_KEYS) <= set(entry)
        assert 0 <= entry[COMM_WAIT] <= entry[TRAIN_TIME]
        assert entry[COMM_RATE] > 0 and entry[SLOWEST_RANK] in (0, 1) and entry[SLOWEST_LAG] >= 0


def _size(count):
    return '{:.2f} kB'.format(count / 1e3) if count >= 1e3 else '{} B'.format(int(count))


@pytest.mark.slow
@pytest.mark.parametrize('name', ['default', 'overlapped', 'fp16', 'powersgd', 'slow_rank'])
def test_rank_zero_alone_prints_one_line_per_epoch_with_the_history_figures(ranks, name):
    rank0, rank1 = scenario_values(ranks, name)
    assert LINE.findall(rank1['out']) == []
    lines = LINE.findall(rank0['out'])
    assert [(int(epoch), int(epochs)) for epoch, epochs, _ in lines] == [(1, EPOCHS), (2, EPOCHS)], rank0['out']
    for (_, _, text), entry in zip(lines, rank0['history']):
        assert text.startswith('each rank sent {} ({} per step), waited {:.3f} s of {:.3f} s training ('.format(
            _size(entry[COMM_BYTES]), _size(entry[COMM_BYTES] / BATCHES), entry[COMM_WAIT], entry[TRAIN_TIME])), text
        assert text.endswith(' %) on communication compute did not hide, link {:.1f} Mbit/s; slowest rank {}, '
                             '{:.3f} s of compute behind rank {}'.format(
                                 entry[COMM_RATE], entry[SLOWEST_RANK], entry[SLOWEST_LAG],
                                 1 - entry[SLOWEST_RANK])), text


@pytest.mark.slow
def test_off_leaves_the_history_and_the_output_alone(ranks):
    rank0, rank1 = scenario_values(ranks, 'off')
    assert LINE.findall(rank0['out']) == [] and rank0['out'] == rank1['out'] == ''
    assert not set(REPORT_KEYS) & set(rank0['history'][0])


@pytest.mark.slow
def test_a_verbose_0_trial_prints_nothing_and_the_history_keeps_the_figures(ranks):
    rank0, rank1 = scenario_values(ranks, 'quiet')
    assert rank0['out'] == rank1['out'] == ''
    assert [entry[COMM_BYTES] for entry in rank0['history']] == [BATCHES * _plain_bytes()] * EPOCHS


@pytest.mark.slow
def test_the_training_time_ends_after_every_callbacks_end_of_pass_work(ranks):
    # The callback sleeping in on_end_training sits after the report: its time is the pass's, as DiLoCo's last
    # meeting is, wherever the report sits. A lower bound only, which load cannot break: the old clock stopped
    # before the sleep and measured the 8 tiny steps alone.
    for entry in scenario_values(ranks, 'end_of_pass')[0]['history']:
        assert END_OF_PASS <= entry[TRAIN_TIME], entry


@pytest.mark.slow
def test_a_rank_that_computes_longer_is_named_with_its_lag(ranks):
    rank0, _ = scenario_values(ranks, 'slow_rank')
    for entry in rank0['history']:
        assert entry[SLOWEST_RANK] == 1
        # rank 1 slept SLEEP per step; rank 0 waited that long for it, which is not counted as the network's
        assert entry[SLOWEST_LAG] >= 0.7 * BATCHES * SLEEP, entry
        assert entry[COMM_WAIT] < 0.5 * entry[SLOWEST_LAG], entry


def test_the_figures_are_a_function_of_every_rank_row():
    # rank 1 computed 0.5 s longer (9.0 - 0.2 against 9.0 - 0.7); rank 1 waited least: its wait is the network's
    rows = [[9.0, 0.7, 0.9, 1e6, 1.0, 10.0], [9.0, 0.2, 0.4, 1e6, 1.0, 10.0]]
    report = CommunicationReport.figures(rows)
    assert report == {TRAIN_TIME: 9.0, SLOWEST_RANK: 1, SLOWEST_LAG: pytest.approx(0.5), COMM_BYTES: 1000000,
                      COMM_WAIT: 0.2, COMM_RATE: pytest.approx(20.0)}
    assert CommunicationReport.line(report, rows, 0, 3) == (
        'communication, epoch 1/3: each rank sent 1.00 MB (100.00 kB per step), waited 0.200 s of 9.000 s training '
        '(2.2 %) on communication compute did not hide, link 20.0 Mbit/s; slowest rank 1, 0.500 s of compute behind '
        'rank 0')
    # a rank whose traffic nobody counted (DistributedDataParallel): time and the slowest rank only
    uncounted = [[2.0, 0.0, 0.0, 0.0, 0.0, 4.0], [2.0, 0.0, 0.0, 0.0, 0.0, 4.0]]
    report = CommunicationReport.figures(uncounted)
    assert report == {TRAIN_TIME: 2.0, SLOWEST_RANK: 0, SLOWEST_LAG: 0.0}
    assert CommunicationReport.line(report, uncounted, 1, 3) == (
        'communication, epoch 2/3: communication not counted (no AllReduceGradients, nor a callback with traffic()), '
        '2.000 s training; slowest rank 0, 0.000 s of compute behind rank 0')
    # DiLoCo: bytes and waits counted, the seconds in flight not known (its meetings travel while the ranks compute)
    overlapped = [[9.0, 0.7, float('nan'), 1e6, 1.0, 10.0], [9.0, 0.2, float('nan'), 1e6, 1.0, 10.0]]
    report = CommunicationReport.figures(overlapped)
    assert COMM_RATE not in report and report[COMM_WAIT] == 0.2
    assert CommunicationReport.line(report, overlapped, 0, 3) == (
        'communication, epoch 1/3: each rank sent 1.00 MB (100.00 kB per step), waited 0.200 s of 9.000 s training '
        '(2.2 %) on communication compute did not hide, link rate not known (sent while computing); slowest rank 1, '
        '0.500 s of compute behind rank 0')


def test_printed_must_be_none_or_a_bool():
    with pytest.raises(ValueError, match=r"^printed should be None \(follow the Trial's verbose\), True or False, but "
                                         r"given 'yes'$"):
        CommunicationReport(printed='yes')


def test_a_job_of_one_process_reports_nothing(capsys):
    model = nn.Linear(4, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), callbacks=[CommunicationReport()],
                  verbose=0)
    history = trial.with_train_generator(DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)),
                                                    batch_size=4)).run(1)
    assert not set(REPORT_KEYS) & set(history[0]) and capsys.readouterr().out == ''


@pytest.mark.parametrize('compression, element_size', [(None, 4), ('fp16', 2), ('bf16', 2)])
def test_the_engine_counts_payload_bytes_and_times_its_waits(compression, element_size):
    with world_of_one():
        model = _model()
        buckets = GradientBuckets(list(model.parameters()), compression=compression, overlap=False)
        buckets.attach(model)
        for step in range(3):
            buckets.arm()
            model(torch.randn(2, 32)).sum().backward()
            buckets.disarm()
            sent, waited, flight = buckets.traffic()
            assert sent == (step + 1) * _plain_bytes(element_size)
            assert 0 <= waited <= flight
        buckets.detach()


def test_the_plot_script_draws_a_saved_history(tmp_path):
    pytest.importorskip('matplotlib', reason='the plot needs the benchmarks extra (matplotlib)')
    plot = runpy.run_path(os.path.join(ROOT, 'benchmarks', 'plot_comm_report.py'))
    history = [{'loss': 1.0, TRAIN_TIME: 2.0 + e, COMM_WAIT: 0.5, SLOWEST_LAG: 0.1, SLOWEST_RANK: 1,
                COMM_BYTES: 4_800_000, COMM_RATE: 95.0} for e in range(3)]
    path = tmp_path / 'history.json'
    path.write_text(json.dumps(history))
    plot['main']([str(path)])
    assert (tmp_path / 'history.png').stat().st_size > 10_000
    path.write_text(json.dumps([{'loss': 1.0}]))
    with pytest.raises(SystemExit, match=r"has no CommunicationReport figures \('train_s' missing from epoch 1\)"):
        plot['main']([str(path)])


@pytest.mark.slow
def test_the_cost_benchmark_runs():
    result = run_command(python(os.path.join(ROOT, 'benchmarks', 'comm_report_cost.py'), '--quick'), timeout=120,
                         cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert 'counters/step' in result.stdout and "'comm_bytes': " in result.stdout, result.stdout
