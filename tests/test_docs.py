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
    result = run_command(python('-m', 'sphinx', '-W', '--keep-going', '-q', '-b', 'html', DOCS, str(out)),
                         timeout=150)
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def test_docs_build_with_warnings_as_errors(built):
    for page in ('index', 'tutorial', 'launching', 'api', 'troubleshooting', 'performance'):
        assert (built / '{}.html'.format(page)).is_file(), page


def test_tutorial_shows_the_example_callback_code(built):
    tutorial = _text(built / 'tutorial.html')
    with open(os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')) as f:
        example = f.read()
    for line in ('def sync_callbacks(ddp=False):', 'tbd.BroadcastParameters(),',
                 'tbd.AgreeOnStop() if ddp else tbd.AllReduceGradients(),',
                 "callbacks=[tbd.RankZeroOnly(PrintMetrics()), *sync_callbacks(ddp)])",
                 'with tbd.process_group(', 'def worker(args):'):
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
