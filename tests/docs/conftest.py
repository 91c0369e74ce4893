import fcntl
import os

import pytest

from _dist import ROOT, python, run_command


@pytest.fixture(scope='session')
def built(tmp_path_factory, request):
    """The docs built once for every docs test, with README's flags: -n (every reference to the
    package's own objects resolves) and -W (warnings are errors).

    Under pytest-xdist the workers share one build: the first to take the lock builds, the others
    wait for it and read the same pages.
    """
    if not hasattr(request.config, 'workerinput'):  # not a pytest-xdist worker
        return _build(tmp_path_factory.mktemp('html'))
    shared = tmp_path_factory.getbasetemp().parent  # one folder per run, shared by its workers
    with open(str(shared / 'docs.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = shared / 'html'
        if not (out / 'index.html').exists():
            _build(out)
        return out


def _build(out):
    result = run_command(python('-m', 'sphinx', '-n', '-W', '--keep-going', '-q', '-b', 'html',
                                os.path.join(ROOT, 'docs'), str(out)), timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    return out
