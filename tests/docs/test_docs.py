"""The docs behave: they build with warnings as errors, every link resolves, every code block runs
or at least compiles, every command's script and flags exist, and the API reference documents the
public names and only those. Nothing here pins prose: the pages may say things differently.
(tests/docs/test_browser.py checks that nothing overflows in a real browser.)"""
import functools
import glob
import html
import os
import re
import shlex
import subprocess
import sys
from urllib.parse import unquote, urlsplit

import torchbearer_dist

from _dist import ROOT, child_env, python, run_command

DOCS = os.path.join(ROOT, 'docs')


def _sources():
    return sorted(glob.glob(os.path.join(DOCS, '**', '*.rst'), recursive=True))


def _blocks(text, language):
    """The bodies of ``.. code-block:: language`` directives, dedented."""
    blocks = re.findall(r'\.\. code-block:: {}\n(?:   :.*\n)*\n((?:    .*\n|[ \t]*\n)+)'.format(language), text)
    return [re.sub(r'^    ', '', block, flags=re.M) for block in blocks]


def _pages(built):
    """Our own built pages (not the highlighted sources under _modules/, nor search and index pages)."""
    pages = []
    for source in _sources():
        page = built / (os.path.relpath(source, DOCS)[:-len('.rst')] + '.html')
        assert page.is_file(), page
        pages.append(page)
    return pages


def test_every_source_page_is_built(built):
    assert len(_pages(built)) >= 12


def test_every_link_between_pages_and_every_anchor_resolves(built):
    checked, broken = 0, []
    for page in _pages(built):
        text = page.read_text()
        for href in re.findall(r'<(?:a|link|img)\b[^>]*\b(?:href|src)="([^"]+)"', text):
            href = html.unescape(href)
            parts = urlsplit(href)
            if parts.scheme in ('http', 'https', 'mailto') or href.startswith('data:'):
                assert parts.scheme != 'http' or 'localhost' in parts.netloc, 'insecure link {} on {}'.format(
                    href, page.name)
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            checked += 1
            if not target.is_file():
                broken.append('{}: {} (no such file)'.format(page.name, href))
            elif parts.fragment and target.suffix == '.html' and not re.search(
                    r'\bid="{}"'.format(re.escape(unquote(parts.fragment))), _read(str(target))):
                broken.append('{}: {} (no such anchor)'.format(page.name, href))
    assert checked > 200
    assert broken == []


@functools.cache
def _read(path):
    with open(path) as f:
        return f.read()


def test_every_python_block_compiles():
    count = 0
    for source in _sources():
        with open(source) as f:
            for block in _blocks(f.read(), 'python'):
                compile(block, source, 'exec')
                count += 1
    assert count >= 5


def test_quickstart_runs_as_shown_and_learns(tmp_path):
    with open(os.path.join(DOCS, 'index.rst')) as f:
        script = tmp_path / 'quickstart.py'
        script.write_text(_blocks(f.read(), 'python')[0])
    result = run_command(python(str(script)), timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r'\bacc=([0-9.]+)', result.stderr)]
    assert accuracies and accuracies[-1] > 0.8, result.stderr[-2000:]  # separable data: the callbacks train
    assert '1/3(t)' not in result.stdout  # rank 1 prints nothing


def _commands():
    """``(script, flags)`` for every ``python SCRIPT.py --flag ...`` line of the docs' bash blocks."""
    found = []
    for source in _sources():
        with open(source) as f:
            for block in _blocks(f.read(), 'bash'):
                for line in block.replace('\\\n', ' ').splitlines():
                    words = shlex.split(re.sub(r'\s#.*$', '', line), comments=True)
                    for i, word in enumerate(words):
                        if word.endswith('.py') and i and words[i - 1] in ('python', 'python3'):
                            found.append((word, [w.split('=')[0] for w in words[i + 1:] if w.startswith('--')]))
    return found


def test_every_command_names_a_script_that_exists_with_flags_it_accepts():
    commands = _commands()
    assert len(commands) >= 10
    helps = {}
    for script, flags in commands:
        path = os.path.join(ROOT, script)
        assert os.path.isfile(path), script
        with open(path) as f:
            if 'argparse' not in f.read():
                assert not flags, '{} takes no flags'.format(script)
                continue
        if script not in helps:
            helps[script] = subprocess.run([sys.executable, path, '--help'], capture_output=True, text=True,
                                           timeout=120, env=child_env(), cwd=ROOT).stdout
        for flag in flags:
            assert re.search(r'(?<![\w-]){}(?![\w-])'.format(re.escape(flag)), helps[script]), (script, flag)


def test_api_reference_documents_every_public_name_and_nothing_else(built):
    ids = set()
    for page in [built / 'api.html', *sorted((built / 'api').glob('*.html'))]:
        ids |= set(re.findall(r'id="torchbearer_dist\.(\w+)', page.read_text()))
    assert ids == set(torchbearer_dist.__all__)


def test_docs_include_code_by_name_never_by_line_numbers():
    for source in _sources():
        with open(source) as f:
            assert ':lines:' not in f.read(), source


def test_worker_uses_only_public_api():
    with open(os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')) as f:
        example = f.read()
    used = set(re.findall(r'\btbd\.(\w+)', example))
    assert used <= set(torchbearer_dist.__all__), used - set(torchbearer_dist.__all__)
    assert 'from torchbearer_dist import' not in example


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
