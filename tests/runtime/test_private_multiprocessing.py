"""Canary: multiprocessing's exit finalizers, which ``runtime/_supervisor.py`` runs in a rank that exits with
``os._exit``, are still where it reads them, and still unlink a semaphore.

Fails on this Python if an upgrade moved them; the package then warns once (``_supervisor.LOST``) that a failed
rank's semaphores are left to the resource tracker, which warns of them after launch's error.
"""
import sys

from _dist import run_command

# In a process of its own: the finalizers run are every one of the process's (a queue's, a lock's).
_SCRIPT = r'''
import multiprocessing, warnings
from multiprocessing import synchronize, util
from torchbearer_dist.runtime import _supervisor

class Owner:
    pass

warnings.simplefilter('error')  # a LOST warning fails the run
ran, owner = [], Owner()
lock = multiprocessing.get_context('spawn').Lock()  # a named semaphore, as in a rank under spawn or forkserver
util.Finalize(owner, ran.append, args=('exit priority',), exitpriority=0)
util.Finalize(owner, ran.append, args=('none',))  # run only when the owner is collected
_supervisor.release_multiprocessing_objects()
try:
    synchronize.sem_unlink(lock._semlock.name)
    print('still linked', ran)
except FileNotFoundError:
    print('unlinked', ran)
'''


def test_the_exit_finalizers_unlink_a_semaphore_and_run_nothing_without_an_exit_priority():
    result = run_command([sys.executable, '-c', _SCRIPT], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "unlinked ['exit priority']", result.stdout + result.stderr[-3000:]
