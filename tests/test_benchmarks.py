"""A smoke run of the benchmark: it runs end to end and writes what the docs show. No timing is asserted."""
import csv
import os

import pytest

from _dist import ROOT, python, run_command

MODELS = ['mlp', 'cnn', 'mlp64']
CONTENDERS = ['single-1-thread', 'single-all-cores', 'ddp', 'per-param-recipe', 'ours', 'ours-overlap',
              'ours-small-buckets', 'ours-sync-every-2', 'ours-fp16', 'ours-bf16', 'comm-floor']


def _read(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    result = run_command(python(os.path.join(ROOT, 'benchmarks', 'run.py'), '--quick', '--out', str(out)),
                         timeout=170, cwd=ROOT)
    assert result.returncode == 0, 'benchmark failed:\nstdout:\n{}\nstderr:\n{}'.format(
        result.stdout[-3000:], result.stderr[-3000:])
    return out, result


@pytest.mark.slow
def test_quick_run_writes_every_model_and_contender(quick_run):
    out, result = quick_run
    rows = _read(os.path.join(out, 'results.csv'))
    assert [(r['model'], r['contender']) for r in rows] == [(m, c) for m in MODELS for c in CONTENDERS]
    for row in rows:
        assert float(row['samples_per_s']) > 0, row
        assert float(row['step_ms']) > 0, row
    for row in rows:
        if row['contender'] not in ('single-1-thread', 'single-all-cores', 'comm-floor'):
            assert float(row['ratio_to_ddp']) > 0 and float(row['scaling_efficiency']) > 0, row
            assert float(row['peak_rss_mib_rank0']) > 0 and float(row['peak_rss_mib_rank1']) > 0, row
    assert 'RANDOM data' in result.stdout and 'MODEL, not a measurement' in result.stdout


@pytest.mark.slow
def test_quick_run_writes_table_projection_and_plot(quick_run):
    out, _ = quick_run
    table = _read(os.path.join(out, 'table.csv'))
    assert list(table[0]) == ['model', 'contender', 'samples_per_s', 'ratio_to_ddp', 'scaling_efficiency',
                              'fraction_of_floor', 'step_ms', 'cpu_ms_rank0', 'peak_rss_mib_rank0',
                              'peak_rss_mib_rank1']
    assert len(table) == len(MODELS) * len(CONTENDERS)
    projected = _read(os.path.join(out, 'projection.csv'))
    assert len(projected) == len(MODELS) * 3 * 2 * 6  # links x wire dtypes x machine counts
    assert {r['link_gbit'] for r in projected} == {'1', '10', '100'}
    for row in projected:
        assert float(row['samples_per_s']) > 0 and 0 < float(row['scaling_efficiency']) <= 1.0, row
    with open(os.path.join(out, 'performance.png'), 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_bad_arguments_are_refused():
    result = run_command(python(os.path.join(ROOT, 'benchmarks', 'run.py'), '--models', 'resnet'), timeout=60)
    assert result.returncode == 2 and 'unknown models or contenders: resnet' in result.stderr
