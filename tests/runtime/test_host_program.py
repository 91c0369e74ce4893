"""A guest in the user's process: the package leaves the program's signal handlers, exit handlers,
excepthook and exit status as it found them (issue 25).

The host is a program of the user's, as submitit and Lightning run one: it sets its own SIGTERM and
SIGUSR1 handlers, an exit handler and an excepthook, trains two hand-started ranks inside
``process_group`` with a Checkpoint under SLURM's ``SLURM_JOB_ID``, leaves the group, then signals
itself and exits with a status of its own.
"""
import subprocess
import sys

import pytest

from _dist import ROOT, STARTUP, child_env, free_port, run_command
from _faults import _wait_all

#: The host program: its own handlers before the package is imported, a Trial inside the group,
#: and its own checks after it.
HOST_SCRIPT = """
import atexit, os, signal, sys
seen = []
def on_term(signum, frame):
    seen.append('SIGTERM')
def on_usr1(signum, frame):
    seen.append('SIGUSR1')
def hook(kind, value, traceback):
    sys.__excepthook__(kind, value, traceback)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
sys.excepthook = hook
atexit.register(lambda: print('host exit handler', flush=True))
mine = lambda: (signal.getsignal(signal.SIGTERM) is on_term, signal.getsignal(signal.SIGUSR1) is on_usr1,
                sys.excepthook is hook)

import torch
from torch.utils.data import TensorDataset
from torchbearer import Trial
import torchbearer_dist as tbd
print('imported', mine(), flush=True)

rank, port, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(64, 4)
data = TensorDataset(x, (x.sum(dim=1) > 0).long())
with tbd.process_group(rank=rank, world_size=2, host='127.0.0.1', port=port, backend='gloo', timeout=60,
                       rendezvous_timeout=10):
    model = torch.nn.Linear(4, 2)
    callbacks = [tbd.Checkpoint(os.path.join(folder, 'run.pt'), every_steps=2), *tbd.distributed_callbacks()]
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                  callbacks=callbacks, verbose=0)
    trial.with_generators(tbd.distributed_loader(data, batch_size=8)).run(2)
    print('inside', mine(), flush=True)
print('left', mine(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # after the group: the host's own handler, never a pre-emption
os.kill(os.getpid(), signal.SIGUSR1)
print('signals', seen, flush=True)
sys.exit(3)
"""


@pytest.mark.slow
def test_a_host_program_keeps_its_handlers_exit_handler_and_exit_status(tmp_path):
    script = tmp_path / 'host.py'
    script.write_text(HOST_SCRIPT)
    port = free_port()
    env = child_env(TORCH_CPP_LOG_LEVEL='FATAL', SLURM_JOB_ID='4242')
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=env, cwd=ROOT) for rank in range(2)]
    _, results = _wait_all(ranks, STARTUP + 60)
    for rank, (process, (status, err)) in enumerate(zip(ranks, results)):
        out = process.stdout.read()
        mine = ('imported', 'inside', 'left', 'signals', 'host')
        lines = [line for line in out.splitlines() if line.startswith(mine)]
        # inside the group, torch's init_process_group wraps the excepthook to prefix the rank: given back after
        assert (status, lines) == (3, ['imported (True, True, True)', 'inside (True, True, False)',
                                       'left (True, True, True)', "signals ['SIGTERM', 'SIGUSR1']",
                                       'host exit handler']), 'rank {}: {}{}'.format(rank, out, err)
    assert (tmp_path / 'run.pt').exists()  # the Checkpoint did its work  # the Checkpoint did its work


#: What importing the package, and a process group of one, register process-wide.
IMPORT_SCRIPT = """
import atexit, signal, sys
import torch, torch.distributed, torch.distributed.nn, torchbearer
def handlers():
    return (sys.excepthook, signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
            signal.getsignal(signal.SIGUSR1), signal.set_wakeup_fd(-1))
before, exits = handlers(), atexit._ncallbacks()  # it counts an unregistered handler's slot too
import torchbearer_dist as tbd
imported, exits = handlers(), atexit._ncallbacks() - exits
with tbd.process_group(rank=0, world_size=1, backend='gloo'):
    pass
print(before == imported, exits, imported == handlers())
"""


def test_importing_the_package_and_a_group_change_nothing_process_wide(tmp_path):
    script = tmp_path / 'imports.py'
    script.write_text(IMPORT_SCRIPT)
    done = run_command([sys.executable, str(script)], timeout=STARTUP + 30, env=child_env(SLURM_JOB_ID='4242'),
                       cwd=ROOT)
    assert (done.returncode, done.stdout) == (0, 'True 0 True\n'), done.stderr
