"""Smoke runs of the benchmarks: they run end to end and write what the docs show. No timing is asserted."""
import csv
import json
import os
import sys

import pytest

from _dist import ROOT, python, run_command

sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import netns  # noqa: E402
import projection  # noqa: E402

MODELS = ['mlp', 'cnn', 'mlp64']
CONTENDERS = ['single-1-thread', 'single-all-cores', 'ddp', 'ddp-fp16-hook', 'ddp-powersgd-hook', 'per-param-recipe',
              'ours', 'ours-overlap', 'ours-small-buckets', 'ours-sync-every-2', 'ours-fp16', 'ours-bf16',
              'ours-powersgd', 'comm-floor']
MULTIHOST = ['single-1-thread', 'ddp', 'ddp-powersgd-hook', 'ours', 'ours-powersgd']


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
    assert list(table[0]) == ['model', 'contender', 'samples_per_s', 'ratio_to_ddp', 'scaling_efficiency', 'step_ms']
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


@pytest.mark.slow
def test_multihost_quick_run_measures_bytes_and_projects():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    out = os.path.join(ROOT, 'benchmarks', 'results', 'multihost', 'smoke-{}'.format(os.getpid()))
    try:
        result = run_command(python(os.path.join(ROOT, 'benchmarks', 'multihost.py'), '--quick', '--links',
                                    '100mbit', '--models', 'mlp', '--contenders', ','.join(MULTIHOST), '--out', out),
                             timeout=240, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        if 'skipped' in result.stdout:
            pytest.skip(result.stdout.strip().splitlines()[-1])
        rows = _read(os.path.join(out, 'multihost.csv'))
        assert [(r['link'], r['model'], r['contender']) for r in rows] == [('100mbit', 'mlp', c) for c in MULTIHOST]
        by_name = {r['contender']: r for r in rows}
        for name in MULTIHOST[1:]:
            assert float(by_name[name]['wire_kb_per_step']) > 0 and float(by_name[name]['projected']) > 0
        # the qdisc counters see the compression: PowerSGD sends a fraction of what fp32 sends
        assert float(by_name['ours-powersgd']['wire_kb_per_step']) < float(by_name['ours']['wire_kb_per_step']) / 4
        with open(os.path.join(out, 'multihost.png'), 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    finally:
        import shutil
        shutil.rmtree(out, ignore_errors=True)


def test_projection_buckets_like_ddp():
    # DDP closes a bucket after the tensor that reaches its capacity: the 1.2M CNN's first bucket is
    # fc2.bias, fc2.weight, fc1.bias, fc1.weight (4.72 MB), the second its convolutions.
    sizes = [288, 32, 18432, 64, 1179648, 128, 1280, 10]
    assert projection.ddp_buckets(sizes) == [[7, 6, 5, 4], [3, 2, 1, 0]]
    dense, p, q = projection.powersgd_values([(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,),
                                              (10, 128), (10,)], rank=4)
    # conv1 (32x9) and the biases travel whole; conv2 (64x288), fc1 (128x9216) and fc2 (10x128) as P and Q
    assert (dense, p, q) == (288 + 32 + 64 + 128 + 10, (64 + 128 + 10) * 4, (288 + 9216 + 128) * 4)


def test_the_performance_plot_is_the_page_width_and_its_text_legible(tmp_path, monkeypatch):
    """Regenerated from the quiet run as the performance page says: 720 px wide, the width of the page's
    text column, so that its 11 pt text shows at about 15 px."""
    import struct

    import matplotlib.figure
    import plot_multihost

    sizes = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(figure, *args, **kwargs):
        sizes.extend(text.get_fontsize() for text in figure.findobj(matplotlib.text.Text) if text.get_text())
        return real_savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', savefig)
    rows = plot_multihost.read_rows(os.path.join(ROOT, 'benchmarks', 'results', 'multihost', 'quiet'))
    plot_multihost.calibrate(rows)
    plot_multihost.plot(str(tmp_path / 'plot.png'), rows, '')
    with open(tmp_path / 'plot.png', 'rb') as f:
        header = f.read(24)
    assert header[:8] == b'\x89PNG\r\n\x1a\n'
    assert struct.unpack('>I', header[16:20])[0] == 720
    assert sizes and min(sizes) >= 11


@pytest.mark.slow
def test_fault_tolerant_cost_runs_every_mode_and_times_the_managers_rounds(tmp_path):
    # benchmarks/ft.py patches the fault-tolerant callback's methods to time them: one renamed broke it silently
    # (its workers' stderr went nowhere) until a measurement was asked of it
    pytest.importorskip('torchft')
    out = tmp_path / 'cost.json'
    result = run_command(python(os.path.join(ROOT, 'benchmarks', 'ft.py'), 'cost', '--model', 'mlp', '--repeats', '1',
                                '--steps', '12', '--out', str(out)), timeout=170, cwd=ROOT)
    assert result.returncode == 0, 'benchmark failed:\nstdout:\n{}\nstderr:\n{}'.format(
        result.stdout[-3000:], result.stderr[-3000:])
    rows = json.loads(out.read_text())['rows']
    assert sorted(r['mode'] for r in rows) == ['ft', 'sync', 'sync-flat'] and all(r['ms_per_step'] > 0 for r in rows)
    ft = next(r for r in rows if r['mode'] == 'ft')
    assert ft['quorum_ms'] > 0 and ft['commit_ms'] > 0 and ft['all_reduce_ms'] > 0, ft
