import os

import pytest

from _dist import ROOT, python, run_command


@pytest.fixture(scope='session')
def built(tmp_path_factory):
    """The docs built once for every docs test, with README's flags: -n (every reference to the
    package's own objects resolves) and -W (warnings are errors)."""
    out = tmp_path_factory.mktemp('html')
    result = run_command(python('-m', 'sphinx', '-n', '-W', '--keep-going', '-q', '-b', 'html',
                                os.path.join(ROOT, 'docs'), str(out)), timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    return out
