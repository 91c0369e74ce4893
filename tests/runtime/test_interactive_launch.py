"""launch() from an interactive session: a function of ``__main__`` with no file (a Jupyter cell, ``python -c``).

Spawned ranks cannot import such a function, so launch forks them; a rank that dies before it can
report (as a spawned one does there) leaves its last stderr lines in the launcher's error.
"""
import sys

import pytest

from torchbearer_dist.runtime.launcher import _start_method

from _dist import run_command

pytestmark = pytest.mark.slow

SESSION = '''
import torch
import torchbearer_dist as tbd

def train(offset):
    value = torch.tensor([float(tbd.current_env().rank + offset)])
    torch.distributed.all_reduce(value)
    return value.item()

print('results', tbd.launch(train, 2, args=(1,), deadline=90))
try:
    tbd.launch(train, 2, args=(1,), start_method='spawn', deadline=90)
except RuntimeError as error:
    print('first line:', str(error).splitlines()[0])
'''


def test_a_function_of_an_interactive_session_runs_forked_and_spawn_failure_names_its_cause():
    result = run_command([sys.executable, '-c', SESSION], timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert 'results [3.0, 3.0]' in result.stdout  # (0 + 1) + (1 + 1) on each rank
    assert ("first line: rank 0 exited with status 1 before reporting an error; its last lines on stderr: "
            "AttributeError: Can't get attribute 'train' on <module '__main__' (built-in)>") in result.stdout, \
        result.stdout


def test_start_method_is_checked():
    with pytest.raises(ValueError, match=r"^start_method should be 'spawn', 'fork', 'forkserver' or None \(chosen "
                                         r"for fn\), but given 'thread'$"):
        _start_method(print, 'thread')
    assert _start_method(_start_method, None) == 'spawn'  # a module's function: spawn imports it
