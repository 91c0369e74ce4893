"""A real one-node SLURM cluster on localhost for the tests: slurmctld and slurmd in a temporary directory.

The cluster lives for one ``with one_node(tmp_path)`` block, with its own ports and ``auth/none``, so no munge
daemon and nothing in /etc is needed. Where it cannot be started within :data:`START_SECONDS` (a daemon that
refuses this machine), the test skips saying why; :data:`REQUIRES` skips it where slurm-wlm is missing or this
is not root. On the way out every job still known is cancelled, both daemons are stopped, and any process left
of the cluster (a job's, a slurmstepd) is killed by its pid and named in :attr:`Cluster.leftovers`.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import time

import pytest

from _dist import child_env, kill_session

SLURM = {name: shutil.which(name) for name in ('slurmctld', 'slurmd', 'srun', 'sinfo', 'sbatch', 'scontrol',
                                               'squeue', 'scancel')}
#: Seconds the one-node cluster may take to report its node idle before the test skips.
START_SECONDS = 60
#: Seconds the jobs still known at the end may take to leave after ``scancel``.
CANCEL_SECONDS = 30

#: The marks of a test on the cluster: slow, and skipped where slurm-wlm is missing or this is not root.
REQUIRES = [
    pytest.mark.slow,
    pytest.mark.skipif(None in SLURM.values(), reason='SLURM is not installed (Debian: apt-get install -y '
                                                      'slurm-wlm); missing: {}'.format(
                                                          [name for name, path in SLURM.items() if path is None])),
    pytest.mark.skipif(os.geteuid() != 0, reason='slurmd runs jobs as their user only when it runs as root'),
]

# OverSubscribe=FORCE: jobs share the node's CPUs, so several one-CPU jobs run at once on a 2-core machine.
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


class Cluster:
    """A started one-node cluster: ``env`` runs its commands (its ``SLURM_CONF``), ``directory`` holds its files."""

    def __init__(self, directory, env):
        self.directory, self.env = directory, env
        self.leftovers = []  # (pid, command line) of the cluster's processes that outlived its daemons, killed

    def run(self, name, *args, timeout=20):
        """Run SLURM command ``name`` (e.g. ``'scontrol'``) against this cluster; its CompletedProcess, text."""
        return subprocess.run([SLURM[name], *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def log_tail(self):
        """The last error lines of both daemons' logs, in one line."""
        tails = []
        for name in ('slurmctld.log', 'slurmd.log'):
            path = os.path.join(self.directory, name)
            if os.path.exists(path):
                with open(path) as f:
                    lines = [line for line in f if 'error' in line or 'fatal' in line]
                tails.append('{}: {}'.format(name, ' | '.join(line.strip() for line in lines[-3:])))
        return '; '.join(tails)

    def processes(self):
        """The live processes of this cluster: every one whose environment holds its ``SLURM_CONF`` (the daemons,
        each slurmstepd, each job's processes), found in /proc; ``[(pid, command line)]``."""
        mark = ('SLURM_CONF=' + self.env['SLURM_CONF']).encode()
        found = []
        for entry in os.listdir('/proc'):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open('/proc/{}/environ'.format(entry), 'rb') as f:
                        environ = f.read().split(b'\0')
                    with open('/proc/{}/cmdline'.format(entry), 'rb') as f:
                        command = f.read().replace(b'\0', b' ').decode(errors='replace').strip()
                except OSError:
                    continue
                if mark in environ and command:  # a zombie's command line reads empty
                    found.append((int(entry), command))
        return found

    def cancel_all(self):
        """``scancel`` every job still known, and wait up to :data:`CANCEL_SECONDS` for all to leave the queue."""
        deadline = time.monotonic() + CANCEL_SECONDS
        while time.monotonic() < deadline:
            jobs = self.run('squeue', '-h', '-o', '%i').stdout.split()
            if not jobs:
                return
            self.run('scancel', *jobs)
            time.sleep(0.5)


@contextlib.contextmanager
def one_node(tmp_path):
    """A one-node cluster of ``os.cpu_count()`` CPUs, started in ``tmp_path / 'slurm'``; yields its :class:`Cluster`.

    Skips the test where the node is not up within :data:`START_SECONDS`. On the way out cancels every job, stops
    both daemons, and kills (by pid) whatever process of the cluster is left, naming it in ``leftovers``.
    """
    from torchbearer_dist.runtime.launcher import free_port
    directory = tmp_path / 'slurm'
    for name in ('state', 'spool'):
        (directory / name).mkdir(parents=True)
    conf = directory / 'slurm.conf'
    conf.write_text(CONF.format(ctld_port=free_port(), slurmd_port=free_port(), dir=directory,
                                cpus=os.cpu_count() or 1))
    env = child_env(SLURM_CONF=str(conf))
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
        env.pop(name, None)
    cluster, daemons = Cluster(directory, env), []
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
            state = cluster.run('sinfo', '-h', '-o', '%t').stdout.strip()
        if state not in ('idle', 'mix', 'alloc'):
            pytest.skip('a one-node SLURM did not come up within {} s (node state {!r}; {})'.format(
                START_SECONDS, state, cluster.log_tail()))
        yield cluster
    finally:
        try:
            if all(d.poll() is None for d in daemons):
                cluster.cancel_all()
        finally:
            stop_daemons(daemons)
            for pid, command in cluster.processes():
                cluster.leftovers.append((pid, command))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def stop_daemons(processes):
    """SIGTERM each daemon's session, wait up to 10 s each, then SIGKILL whatever of its session is left."""
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
