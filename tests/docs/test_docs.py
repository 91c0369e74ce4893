"""The Sphinx docs build with warnings as errors, and the tutorial shows the example's real code."""
import html
import os
import re

import pytest

import torchbearer_dist

from _dist import ROOT, python, run_command

DOCS = os.path.join(ROOT, 'docs')


def _text(page):
    """A rendered page as plain text: tags dropped (highlighting splits code into spans), entities decoded."""
    with open(page) as f:
        return html.unescape(re.sub(r'<[^>]+>', '', f.read()))


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp('html')
    # -n: every reference to the package's own objects resolves (README's command: sphinx-build -n -W)
    result = run_command(python('-m', 'sphinx', '-n', '-W', '--keep-going', '-q', '-b', 'html', DOCS, str(out)),
                         timeout=150)
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def test_docs_build_with_warnings_as_errors(built):
    for page in ('index', 'tutorial', 'own_script', 'scaling', 'launching', 'api', 'troubleshooting', 'performance'):
        assert (built / '{}.html'.format(page)).is_file(), page


def test_tutorial_shows_the_example_callback_code(built):
    tutorial = _text(built / 'tutorial.html')
    with open(os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')) as f:
        example = f.read()
    for line in ('def sync_callbacks(ddp=False):', 'tbd.BroadcastParameters(),',
                 'tbd.AgreeOnStop() if ddp else tbd.AllReduceGradients(),',
                 "callbacks = [tbd.RankZeroOnly(PrintMetrics()), *sync_callbacks(ddp)]",
                 'with tbd.process_group(', 'def worker(args):', 'env = tbd.current_env()'):
        assert line in example, line  # the tutorial quotes the example as it is now
        assert line in tutorial, line
    assert 'distributed_callbacks(flatten_images=True' in tutorial
    assert 'neither authenticated nor encrypted' in tutorial


def test_api_reference_documents_every_public_name(built):
    with open(built / 'api.html') as f:
        ids = set(re.findall(r'id="torchbearer_dist\.(\w+)"', f.read()))
    assert set(torchbearer_dist.__all__) - ids == set()


def test_tutorial_includes_code_by_name_never_by_line_numbers():
    for name in os.listdir(DOCS):
        if name.endswith('.rst'):
            with open(os.path.join(DOCS, name)) as f:
                assert ':lines:' not in f.read(), name


def test_tutorial_shows_send_recv_and_the_collective_broadcast(built):
    tutorial = _text(built / 'tutorial.html')
    for text in ('dist.broadcast(flat, src)', 'dist.send(flat, other)', 'dist.recv(flat, src)',
                 "BroadcastParameters(method='p2p')", "method='broadcast'",
                 'dist.all_reduce(bucket.wire, async_op=True)', 'What each callback does in torch.distributed calls'):
        assert text in tutorial, text
    assert 'fit one bucket, so here nothing overlaps' in re.sub(r'\s+', ' ', tutorial)


def test_worker_uses_only_public_api():
    with open(os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')) as f:
        example = f.read()
    used = set(re.findall(r'\btbd\.(\w+)', example))
    assert used <= set(torchbearer_dist.__all__), used - set(torchbearer_dist.__all__)
    assert 'from torchbearer_dist import' not in example


def test_own_script_page_covers_what_a_cpu_user_looks_for(built):
    page = re.sub(r'\s+', ' ', _text(built / 'own_script.html'))
    for text in ('Build the Trial inside the process group',
                 'distributed_loader(data, batch_size=BATCH_SIZE, shuffle=True)', 'Threads per rank',
                 'Goyal et al.', 'Checkpoint and resume', 'torchrun --nnodes 2',
                 'ScaleLearningRate'):
        assert text in page, text


def test_docstring_examples_run_as_written():
    """Every ``>>>`` example of the API reference runs, given what its preamble says is defined."""
    import doctest
    import importlib
    import io
    import pkgutil
    from contextlib import redirect_stdout

    import torch
    from torchbearer import Trial

    model = torch.nn.Linear(784, 10)
    preamble = dict(torch=torch, Trial=Trial, model=model, loss=torch.nn.CrossEntropyLoss(),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    failed, examples, report = [], 0, io.StringIO()
    names = ['torchbearer_dist'] + [info.name for info in pkgutil.walk_packages(torchbearer_dist.__path__,
                                                                                'torchbearer_dist.')]
    for name in names:
        with redirect_stdout(report):
            result = doctest.testmod(importlib.import_module(name), extraglobs=preamble, report=False)
        examples += result.attempted
        if result.failed:
            failed.append(name)
    assert examples > 20
    assert failed == [], report.getvalue()[-5000:]

