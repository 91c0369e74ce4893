"""srun -N 2 -n 2 across two SLURM nodes made of network namespaces, with no address given.

node1 and node2 are two network namespaces on a veth pair (:class:`_netns.TwoHosts`); each runs
``slurmd -N nodeN`` under ``unshare --uts`` (its host name is nodeN), and node1 also runs slurmctld
on its namespace address. Node names resolve through ``/etc/netns/NS/hosts``, which ``ip netns
exec`` mounts over ``/etc/hosts``. The cluster uses ``auth/none`` and no cgroup plugin (``ip netns
exec`` mounts a /sys without a cgroup tree), and lives in a temporary directory. Neither
MASTER_ADDR nor ``--host`` is given: every rank takes rank 0's address from the first node of
``SLURM_STEP_NODELIST`` and the port from the job id, and the job trains. Where the daemons do not
come up within :data:`START_SECONDS`, the test skips with slurmctld's and slurmd's log tails.
"""
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from _dist import ROOT, child_env, run_command
from _netns import TwoHosts
from _slurm import stop_daemons

SLURM = {name: shutil.which(name) for name in ('slurmctld', 'slurmd', 'srun', 'sinfo', 'unshare')}
EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
OWN_SCRIPT = os.path.join(ROOT, 'examples', 'own_script.py')
PYTHON = os.path.join(ROOT, '.venv', 'bin', 'python')
#: Seconds the two nodes may take to report idle before the test skips.
START_SECONDS = 30
#: Seconds one srun may take on a busy machine.
RUN_TIMEOUT = 150
NAMES = ('node1', 'node2')

pytestmark = [
    pytest.mark.slow, pytest.mark.netns,
    pytest.mark.skipif(None in SLURM.values(), reason='SLURM is not installed (Debian: apt-get install -y '
                                                      'slurm-wlm); missing: {}'.format(
                                                          [name for name, path in SLURM.items() if path is None])),
    pytest.mark.skipif(os.geteuid() != 0, reason='slurmd runs jobs as their user only when it runs as root'),
    pytest.mark.timeout(500),
]

CONF = '''\
ClusterName=tbdtwo
SlurmctldHost=node1({address0})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=node1 NodeAddr={address0} CPUs={cpus} State=UNKNOWN
NodeName=node2 NodeAddr={address1} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
'''


def _in_node(hosts, node, argv):
    """``argv`` run on node 0 or 1: its namespace, and its own host name."""
    inner = ' '.join("'{}'".format(part) for part in argv)
    return hosts.command(node, [SLURM['unshare'], '--uts', 'sh', '-c',
                                'hostname {}; exec {}'.format(NAMES[node], inner)])


def _log_tail(directory):
    tails = []
    for name in sorted(os.listdir(directory)):
        if name.endswith('.log'):
            with open(os.path.join(directory, name)) as f:
                lines = [line.strip() for line in f if 'error' in line or 'fatal' in line]
            tails.append('{}: {}'.format(name, ' | '.join(lines[-3:])))
    return '; '.join(tails)


def _kill_namespaces(hosts):
    """SIGKILL, by id, whatever still runs in the two namespaces (a step left by an srun killed at its timeout)."""
    for namespace in hosts.namespaces:
        listed = subprocess.run(['ip', 'netns', 'pids', namespace], capture_output=True, text=True, timeout=20)
        for pid in listed.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _node_states(hosts, env):
    probe = subprocess.run(_in_node(hosts, 0, [SLURM['sinfo'], '-h', '-N', '-o', '%N %t']), env=env,
                           capture_output=True, text=True, timeout=20)
    return dict(line.split() for line in probe.stdout.splitlines() if len(line.split()) == 2)


@pytest.fixture
def cluster(tmp_path):
    if not os.path.exists(PYTHON):
        pytest.skip('the examples run with the checkout\'s .venv python, and {} is missing'.format(PYTHON))
    with TwoHosts() as hosts:
        directory = tmp_path / 'slurm'
        etc = ['/etc/netns/{}'.format(ns) for ns in hosts.namespaces]
        daemons = []
        try:
            for folder in etc:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, 'hosts'), 'w') as f:
                    f.write('127.0.0.1 localhost\n')
                    f.writelines('{} {}\n'.format(hosts.address(i), NAMES[i]) for i in range(2))
            for name in ('state', 'spool/node1', 'spool/node2'):
                (directory / name).mkdir(parents=True)
            conf = directory / 'slurm.conf'
            conf.write_text(CONF.format(address0=hosts.address(0), address1=hosts.address(1), ctld_port=6817,
                                        slurmd_port=6818, dir=directory, cpus=min(os.cpu_count() or 1, 4)))
            (directory / 'cgroup.conf').write_text('CgroupPlugin=cgroup/v1\n')
            env = child_env(SLURM_CONF=str(conf))
            for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
                env.pop(name, None)
            for name in [n for n in env if n.startswith('SLURM_') and n != 'SLURM_CONF']:
                env.pop(name)
            for node, command in ((0, [SLURM['slurmctld'], '-D', '-i', '-f', str(conf)]),
                                  (0, [SLURM['slurmd'], '-D', '-N', 'node1', '-f', str(conf)]),
                                  (1, [SLURM['slurmd'], '-D', '-N', 'node2', '-f', str(conf)])):
                daemons.append(subprocess.Popen(_in_node(hosts, node, command), env=env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL, start_new_session=True))
            deadline, states = time.monotonic() + START_SECONDS, {}
            ready = ('idle', 'mix', 'alloc')
            while time.monotonic() < deadline and not (len(states) == 2 and all(s in ready for s in states.values())):
                if any(d.poll() is not None for d in daemons):
                    break
                time.sleep(1)
                states = _node_states(hosts, env)
            if not (len(states) == 2 and all(s in ready for s in states.values())):
                pytest.skip('a two-node SLURM did not come up within {} s (node states {!r}; {})'.format(
                    START_SECONDS, states, _log_tail(str(directory))))
            hosts.env, hosts.directory = env, directory
            yield hosts
        finally:
            stop_daemons(daemons)
            _kill_namespaces(hosts)
            for folder in etc:
                shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize('script, args, done', [
    (EXAMPLE, ('--epochs', '1', '--download', 'never', '--threads', '1'), r'^epoch 1/1: loss [\d.]+ acc'),
    (OWN_SCRIPT, ('--epochs', '1'), r'^epochs 1: loss [\d.]+ acc'),
], ids=['example', 'own_script'])
def test_srun_on_two_nodes_trains_with_no_address(cluster, tmp_path, script, args, done):
    cwd = tmp_path / 'run'
    cwd.mkdir()
    command = _in_node(cluster, 0, [SLURM['srun'], '-N', '2', '-n', '2', '--export=ALL', '--kill-on-bad-exit=1',
                                    '--chdir', str(cwd), '--label', PYTHON, script, *args])
    result = run_command(command, timeout=RUN_TIMEOUT, env=cluster.env, cwd=str(cwd))
    print('srun -N 2 -n 2 {}: exit {} after {:.1f} s\n{}{}'.format(
        os.path.basename(script), result.returncode, result.elapsed, result.stdout, result.stderr))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:] + _log_tail(str(cluster.directory))
    lines = [line.split(': ', 1) for line in result.stdout.splitlines() if ': ' in line]
    trained = [(rank.strip(), text) for rank, text in lines if re.match(done, text)]
    assert [rank for rank, _ in trained] == ['0'], result.stdout  # printed once, by rank 0
    # gloo's listening addresses were found on hosts named node1, node2 (an odd length once hid them)
    assert 'wakes only at the process group' not in result.stderr, result.stderr
