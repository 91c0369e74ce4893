"""torchft's own output, quiet by default: no access line, traceback or torch warning on a replica's stderr for a
heal, a heal cut short or a lost peer; all of it with ``TORCHBEARER_DIST_FT_VERBOSE=1``, and in the logger
``torchbearer_dist.ft.torchft`` where the program configures logging.

Real replica processes (tests/ft/_replica.py) beside a lighthouse in this process, a real heal server in this
process; every process is killed when its test ends.
"""
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from urllib.parse import urlparse

import pytest

from _dist import STARTUP, child_env

pytest.importorskip('torchft', reason='the fault-tolerant mode needs torchft: pip install "torchbearer_dist[ft]"')


from torchbearer_dist.ft import _quiet  # noqa: E402 (after the skip)
from torchbearer_dist.ft.replica import _transport  # noqa: E402

ACCESS_LINE = '"GET /checkpoint/'
BUFFER_WARNING = 'UserWarning: The given buffer is not writable'


def _heal(replicas, verbose):
    """Replica 0 trains; replica 1 starts, heals from it and trains beside it to the end (the conftest's lighthouse
    and replicas). Returns the indices of the two, ended."""
    gate = str(replicas.tmp_path / 'gate')  # replica 0 holds at its 10th step until replica 1 is up
    args = ('--replicas', '2', '--epochs', '2', '--samples', '1200', '--sleep', '0.05', '--timeout', '5')
    with _environment(**({_quiet.VERBOSE: '1'} if verbose else {})):  # child_env copies this process's
        healer = replicas.start(0, *args, '--gate', gate, '--gate-step', '10')
        replicas.wait_for(lambda: replicas.steps(healer) >= 5, STARTUP + 60)
        healed = replicas.start(1, *args)
    replicas.wait_for(lambda: 'READY' in replicas.out(healed), STARTUP + 60)
    open(gate, 'w').close()
    replicas.wait_for(lambda: replicas.done(healer) and replicas.done(healed), STARTUP + 120)
    assert [replicas.process(i).wait(30) for i in (healer, healed)] == [0, 0], replicas.describe()
    assert int(replicas.done(healed)[1]) == 1, replicas.describe()  # it healed
    assert replicas.done(healer)[0] == replicas.done(healed)[0], replicas.describe()
    return healer, healed


@contextlib.contextmanager
def _environment(**values):
    found = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in found.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


@pytest.mark.timeout(300)
def test_a_heal_writes_no_access_line_traceback_or_warning(replicas):
    healer, healed = _heal(replicas, verbose=False)
    for i in (healer, healed):
        # Not counted: torch's C++ log ('[W... Backend.hpp] Warning: setSequenceNumberForGroup() is deprecated',
        # once a process, TORCH_CPP_LOG_LEVEL=ERROR hides it), which is not torchft's Python output.
        err = '\n'.join(line for line in replicas.err(i).splitlines() if not line.startswith('[W'))
        assert ACCESS_LINE not in err and 'Traceback' not in err and 'Warning' not in err, replicas.describe()


@pytest.mark.timeout(300)
def test_the_switch_shows_torchfts_output_as_torchft_writes_it(replicas):
    healer, healed = _heal(replicas, verbose=True)
    assert ACCESS_LINE in replicas.err(healer), replicas.describe()  # the heal server's access line
    assert BUFFER_WARNING in replicas.err(healed), replicas.describe()  # torch's warning on the healed state


@pytest.mark.timeout(180)
@pytest.mark.parametrize('verbose', [False, True])
def test_torchfts_tracebacks_go_to_the_logger_not_stderr(verbose):
    # What torchft's Manager writes for a lost peer (logger.exception of its module's logger), in a process of its
    # own: Python's last resort writes it on stderr where nothing takes it.
    code = ('import logging; from torchbearer_dist.ft import _quiet; from torchbearer_dist.ft.replica import '
            'require_torchft; require_torchft(); _quiet.Quiet.open()\n'
            'try:\n    raise RuntimeError("gloo: Connection closed by peer")\n'
            'except RuntimeError:\n    logging.getLogger("torchft.manager").exception("got exception in work")')
    env = child_env(**({_quiet.VERBOSE: '1'} if verbose else {}))
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=STARTUP + 60,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert ('Traceback' in result.stderr) is verbose, result.stderr


def _cut_heal(transport):
    """A replica that asks for the healer's state and goes before the end of it (its connection reset)."""
    sock = socket.create_connection(('127.0.0.1', urlparse(transport.address()).port), timeout=10)
    sock.sendall(b'GET /checkpoint/7/full HTTP/1.1\r\nHost: healer\r\n\r\n')
    sock.recv(1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))  # a reset, as a killed process
    sock.close()


@pytest.mark.parametrize('verbose', [False, True])
def test_a_heal_cut_short_goes_to_the_logger_not_stderr(verbose, capfd, caplog, monkeypatch):
    import torch
    if verbose:
        monkeypatch.setenv(_quiet.VERBOSE, '1')
    else:
        monkeypatch.delenv(_quiet.VERBOSE, raising=False)
    caplog.set_level(logging.INFO)
    opened, err = _quiet.Quiet.open(), ''

    def seen():
        if verbose:
            return ACCESS_LINE in err
        mine = [r for r in caplog.records if r.name == _quiet.LOGGER]
        theirs = [r for r in caplog.records if r.name.startswith('torchft.') and r.exc_info]
        return any(ACCESS_LINE in r.getMessage() for r in mine) and theirs

    try:
        transport = _transport('127.0.0.1', timedelta(seconds=10))
        try:
            transport.send_checkpoint([1], 7, {'weights': torch.zeros(16 * 2 ** 20)}, timedelta(seconds=10))
            _cut_heal(transport)
            end = time.monotonic() + 20
            while time.monotonic() < end and not seen():
                time.sleep(0.05)
                err += capfd.readouterr().err
        finally:
            transport.shutdown(wait=False)
    finally:
        if opened:
            _quiet.Quiet.close()
    err += capfd.readouterr().err
    assert seen(), (err, caplog.records)
    if verbose:
        assert opened is False  # torchft's output untouched: its access line on stderr
    else:
        # The access line, and torchft's traceback of the cut, in the logger (seen where logging is configured).
        assert ACCESS_LINE not in err and 'Traceback' not in err and 'Exception' not in err, err


def test_quiet_nests_and_puts_back_what_it_found(monkeypatch):
    monkeypatch.delenv(_quiet.VERBOSE, raising=False)
    torchft = logging.getLogger('torchft')
    found = (torchft.level, torchft.propagate, list(torchft.handlers), list(warnings.filters))
    assert _quiet.Quiet.open() and _quiet.Quiet.open()
    assert torchft.propagate is False and torchft.level == logging.WARNING
    _quiet.Quiet.close()
    assert torchft.propagate is False  # the outer one still open
    _quiet.Quiet.close()
    _quiet.Quiet.close()  # one close too many: nothing
    assert (torchft.level, torchft.propagate, list(torchft.handlers), list(warnings.filters)) == found


@pytest.mark.timeout(180)
@pytest.mark.parametrize('verbose', [False, True])
def test_torchfts_rust_log_is_quiet_unless_asked(verbose):
    # A lighthouse logs its start at INFO: shown only where RUST_LOG or the switch asks for it.
    code = ('import os, time; from torchbearer_dist.ft import Lighthouse; server = Lighthouse(bind="127.0.0.1:0"); '
            'time.sleep(1); server.shutdown(); print("RUST_LOG" in os.environ)')
    env = child_env(**({_quiet.VERBOSE: '1'} if verbose else {}))
    env.pop('RUST_LOG', None)
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=STARTUP + 60,
                            env=env)
    assert result.returncode == 0 and result.stdout.strip() == 'False', result.stderr  # os.environ as it was
    assert ('Lighthouse listening on' in result.stderr) is verbose, result.stderr
