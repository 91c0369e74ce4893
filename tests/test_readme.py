"""The README's promises: its snippet runs as shown, and CI runs its test command."""
import os
import re

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
