"""The README's promises: its snippet runs as shown, and CI runs its test command."""
import importlib.util
import json
import os
import re
import shlex

import pytest

from _dist import ROOT, python, run_command


def _readme():
    with open(os.path.join(ROOT, 'README.rst')) as f:
        return f.read()


def _code_blocks(text, language):
    blocks = re.findall(r'\.\. code-block:: {}\n\n((?:    .*\n|\n)+)'.format(language), text)
    return [re.sub(r'^    ', '', block, flags=re.M) for block in blocks]


def test_snippet_runs_as_shown_and_reports_global_metrics(tmp_path):
    snippet = _code_blocks(_readme(), 'python')[0]
    script = tmp_path / 'snippet.py'
    script.write_text(snippet)
    result = run_command(python(str(script)), timeout=90, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = eval(result.stdout.strip().splitlines()[-1], {'__builtins__': {}})  # a dict of floats
    assert set(metrics) >= {'loss', 'acc'}
    assert metrics['acc'] > 0.8


def test_ci_runs_the_readme_test_command():
    commands = _code_blocks(_readme(), 'bash')
    test_command = next(c.strip() for c in commands if 'pytest' in c)
    with open(os.path.join(ROOT, '.ci', 'run')) as f:
        ci = f.read()
    assert test_command in ci


def _shell_lines(text):
    """Every command line of the bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in _code_blocks(text, 'bash'):
        for line in block.replace('\\\n', ' ').splitlines():
            line = re.sub(r'\s+#.*$', '', line).strip()
            if line and not line.startswith('#'):
                lines.append(line)
    return lines


def _pip_installs(line):
    """The argument lists of the ``pip install`` commands in a shell line."""
    return [shlex.split(part)[2:] for part in line.split('&&') if shlex.split(part)[:2] == ['pip', 'install']]


def test_every_shell_line_is_checked_by_a_test():
    """README's shell lines on a fresh clone: each is run here, by CI, or by the test named for it."""
    checked_elsewhere = {
        # the two set-up commands: CI runs the test command verbatim; test_example runs the example
        'python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && '
        'python examples/distributed_data_parallel.py',
        'python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && ruff check . && '
        'python -m pytest',
        'python3 -m venv .venv && . .venv/bin/activate',  # the set-up commands start the same way
        # test_docs builds with these flags; the pip half is checked below
        'pip install ".[docs]" && sphinx-build -n -W -b html docs docs/_build/html',
    }
    for line in _shell_lines(_readme()):
        assert line in checked_elsewhere or (line.startswith('pip install ') and '&&' not in line), line


def test_install_lines_are_quoted_and_resolve_from_the_clone():
    """``pip install`` lines of the README and the docs' index: extras quoted (zsh globs ``[...]``), and
    pip resolves each from this checkout, with extras that pyproject.toml declares."""
    if importlib.util.find_spec('setuptools') is None:
        pytest.skip('setuptools is not installed; pip cannot build the metadata without build isolation')
    with open(os.path.join(ROOT, 'docs', 'index.rst')) as f:
        lines = _shell_lines(_readme()) + _shell_lines(f.read())
    installs = [(line, args) for line in lines for args in _pip_installs(line)]
    assert len(installs) >= 4, installs
    for line, args in installs:
        for arg in args:
            if '[' in arg:
                assert '"{}"'.format(arg) in line, 'unquoted extras in {!r}: zsh reads [...] as a glob'.format(line)
        assert not any(arg.startswith('torchbearer_dist') for arg in args), 'not on PyPI: {!r}'.format(line)
        result = run_command(python('-m', 'pip', 'install', '--dry-run', '--no-deps', '--no-build-isolation',
                                    '--no-index', '--quiet', '--report', '-', *args), timeout=120, cwd=ROOT)
        assert result.returncode == 0, (line, result.stderr[-2000:])
        (install,) = json.loads(result.stdout)['install']
        assert install['metadata']['name'] == 'torchbearer_dist'
        requested = set(install.get('requested_extras') or ())
        assert requested <= set(install['metadata'].get('provides_extra', ())), line
