import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

import torchbearer_dist

# Test files live in one folder per layer (tests/sync/, tests/callbacks/, ...) and import the shared
# helpers (_dist, _netns) from here; spawned ranks inherit this sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _dist import children, cmdline  # noqa: E402 (tests/ on sys.path first)


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell (``cmd &``, nohup) inherits SIGINT
    # ignored, and so would every rank it starts: the Ctrl-C tests would then test nothing and fail.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line('markers', 'gpu: needs CUDA; TORCHBEARER_DIST_TEST_GPU=1 turns the skip into a failure')
    config.addinivalue_line('markers', 'slow: a multi-process test of several seconds')
    config.addinivalue_line('markers', 'netns: builds Linux network namespaces; needs root')
    config.addinivalue_line('markers', 'soak: random faults, or a racy scenario repeated many times; runs only with '
                                       'TORCHBEARER_DIST_TEST_SOAK=1 (CI runs them in a step of their own)')


#: The most pytest-xdist workers ``-n auto`` starts: each runs ranks of its own.
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core this process may run on, plus one, at most :data:`MAX_WORKERS`.

    Measured on the quiet 2-core machine, the whole suite: two workers 459 s, three 426 s; about a
    third of each worker's time is spent waiting (a silent peer noticed, a rank starting).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    return min(cores + 1, MAX_WORKERS)


#: The files that take longest, started first: pytest-xdist hands out whole files in collection order,
#: and one long file started last would leave a worker alone at the end. Measured on a quiet 2-core
#: machine; everything else keeps its order.
LONGEST_FIRST = ['checkpoint/test_step_resume.py', 'runtime/test_faults.py', 'e2e/test_example.py',
                 'runtime/test_soak.py', 'e2e/test_benchmarks.py', 'runtime/test_group_safety.py',
                 'runtime/test_rendezvous_faults.py', 'runtime/test_interrupts.py',
                 'checkpoint/test_example_restarts.py', 'docs/test_docs.py', 'launchers/test_torchrun.py']


def _longest_first(item):
    path = os.path.relpath(str(item.fspath), HERE).replace(os.sep, '/')
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first)  # stable: a file's tests keep their order
    if os.environ.get('TORCHBEARER_DIST_TEST_SOAK') != '1':
        for item in items:
            if 'soak' in item.keywords:
                item.add_marker(pytest.mark.skip(reason='a soak test: set TORCHBEARER_DIST_TEST_SOAK=1'))
    if torch.cuda.is_available() or _gpu_asked():
        return
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(pytest.mark.skip(reason='needs a CUDA device'))


def _gpu_asked():
    """Whether ``TORCHBEARER_DIST_TEST_GPU=1`` asks for the GPU tests (Horovod's ``HOROVOD_TEST_GPU``)."""
    return os.environ.get('TORCHBEARER_DIST_TEST_GPU') == '1'


@pytest.hookimpl(tryfirst=True)  # before the skipping plugin's: a test's own skipif ('needs 1 GPU') would skip it
def pytest_runtest_setup(item):
    """Fail each gpu test where ``TORCHBEARER_DIST_TEST_GPU=1`` asks for the GPU tests and CUDA is missing:
    a GPU session on a machine without a GPU is red, not green with every GPU test skipped."""
    if 'gpu' in item.keywords and _gpu_asked() and not torch.cuda.is_available():
        pytest.fail('CUDA is not available, though TORCHBEARER_DIST_TEST_GPU=1 asks for the GPU tests: run them '
                    'on a machine with a GPU, or unset TORCHBEARER_DIST_TEST_GPU', pytrace=False)


def _signal_state():
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return signal.getsignal(signal.SIGINT), fd


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    """Restore os.environ, destroy any leftover process group, and fail if a child outlives the test
    or the test left SIGINT's handler or the wakeup fd changed."""
    saved, signals = dict(os.environ), _signal_state()
    yield
    assert _signal_state() == signals, 'SIGINT handling was left changed: {} -> {}'.format(signals, _signal_state())
    torchbearer_dist.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
    deadline = time.monotonic() + 5
    while _livechildren() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _livechildren()
    assert not left, 'processes outlived the test: {}'.format({pid: cmdline(pid) for pid in left})


def _livechildren():
    """Children, and the children of multiprocessing's forkserver (run_workers' ranks); neither the
    forkserver nor the resource tracker, which live as long as pytest."""
    found = []
    for pid in children():
        command = cmdline(pid)
        if 'forkserver' in command:
            found.extend(children(pid))
        elif 'resource_tracker' not in command:
            found.append(pid)
    return found
