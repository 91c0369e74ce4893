"""The example under a real SLURM: a one-node cluster on localhost (slurmctld + slurmd) runs ``srun -n 2``.

The cluster lives in a temporary directory for the length of the test, with its own ports and
``auth/none``, so no munge daemon and nothing in /etc is needed. Where it cannot be started within
:data:`START_SECONDS` (no slurm-wlm, not root, a daemon that refuses this machine), the test skips
saying why.
"""
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from torchbearer_dist.runtime.launcher import free_port

from _dist import ROOT, child_env, kill_session, python, run_command

SLURM = {name: shutil.which(name) for name in ('slurmctld', 'slurmd', 'srun', 'sinfo')}
EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
#: Seconds the one-node cluster may take to report its node idle before the test skips.
START_SECONDS = 60
#: Seconds one run of the example may take on a busy 2-core machine.
RUN_TIMEOUT = 150
EPOCH_LINE = re.compile(r'^epoch (\d+)/(\d+): loss ([\d.]+) acc ([\d.]+) val_loss ([\d.]+) val_acc ([\d.]+)$', re.M)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(None in SLURM.values(), reason='SLURM is not installed (Debian: apt-get install -y '
                                                      'slurm-wlm); missing: {}'.format(
                                                          [name for name, path in SLURM.items() if path is None])),
    pytest.mark.skipif(os.geteuid() != 0, reason='slurmd runs jobs as their user only when it runs as root'),
]

CONF = '''\
ClusterName=tbdtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
'''


def _log_tail(directory):
    tails = []
    for name in ('slurmctld.log', 'slurmd.log'):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                lines = [line for line in f if 'error' in line or 'fatal' in line]
            tails.append('{}: {}'.format(name, ' | '.join(line.strip() for line in lines[-3:])))
    return '; '.join(tails)


def _stop(processes):
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        kill_session(process.pid)
        process.wait()


def test_srun_two_tasks_print_metrics_once(tmp_path):
    directory = tmp_path / 'slurm'
    for name in ('state', 'spool'):
        (directory / name).mkdir(parents=True)
    conf = directory / 'slurm.conf'
    conf.write_text(CONF.format(ctld_port=free_port(), slurmd_port=free_port(), dir=directory,
                                cpus=os.cpu_count() or 1))
    env = child_env(SLURM_CONF=str(conf))
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
        env.pop(name, None)
    daemons = []
    try:
        for command in ([SLURM['slurmctld'], '-D', '-i', '-f', str(conf)],
                        [SLURM['slurmd'], '-D', '-N', 'localhost', '-f', str(conf)]):
            daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        deadline, state = time.monotonic() + START_SECONDS, ''
        while time.monotonic() < deadline and state not in ('idle', 'mix', 'alloc'):
            if any(d.poll() is not None for d in daemons):
                break
            time.sleep(1)
            probe = subprocess.run([SLURM['sinfo'], '-h', '-o', '%t'], env=env, capture_output=True, text=True,
                                   timeout=20)
            state = probe.stdout.strip()
        if state not in ('idle', 'mix', 'alloc'):
            pytest.skip('a one-node SLURM did not come up within {} s (node state {!r}; {})'.format(
                START_SECONDS, state, _log_tail(directory)))

        cwd = tmp_path / 'run'
        cwd.mkdir()
        command = [SLURM['srun'], '-n', '2', '--overcommit', '--kill-on-bad-exit=1',
                   *python(EXAMPLE, '--download', 'never', '--host', '127.0.0.1', '--port', str(free_port()),
                           '--epochs', '1')]
        result = run_command(command, timeout=RUN_TIMEOUT, env=env, cwd=str(cwd))
    finally:
        _stop(daemons)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(EPOCH_LINE.findall(result.stdout)) == 1, result.stdout  # once, by rank 0
    assert result.stdout.count('saved the model to') == 1
    assert (cwd / 'mnist_mlp.pt').is_file()
