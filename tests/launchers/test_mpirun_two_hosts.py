"""mpirun -H node1,node2 across two machines made of network namespaces, with no address given.

mpirun runs on node1; OpenMPI's ``plm_rsh_agent`` is a script that starts the remote daemon with
``ip netns exec`` (and its own host name, ``unshare --uts``) instead of ssh. Node names resolve
through ``/etc/netns/NS/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``. With mpi4py,
rank 0's address travels through MPI and both the example and own_script.py train; without it
(hidden by a package that fails to import) every rank stops within seconds with one line.
"""
import os
import re
import shutil
import stat
import sys
import time

import pytest

from _dist import LOAD_SLACK, ROOT, STARTUP, child_env, run_command
from _netns import TwoHosts

MPIRUN = shutil.which('mpirun')
EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
OWN_SCRIPT = os.path.join(ROOT, 'examples', 'own_script.py')
#: Seconds one two-host run may take on a busy 2-core machine.
RUN_TIMEOUT = 120

pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(MPIRUN is None, reason='OpenMPI is not installed (Debian: apt-get install -y '
                                                        'openmpi-bin)'),
              pytest.mark.timeout(400)]

AGENT = '''#!/bin/sh
# OpenMPI's remote shell: "agent HOST COMMAND..." runs COMMAND on HOST's namespace, as ssh would.
host=$1; shift
case "$host" in
{cases}
  *) echo "no such test host: $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $host; $*"
'''


@pytest.fixture
def cluster(tmp_path):
    with TwoHosts() as hosts:
        names = ['node1', 'node2']
        etc = ['/etc/netns/{}'.format(ns) for ns in hosts.namespaces]
        try:
            for folder in etc:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, 'hosts'), 'w') as f:
                    f.write('127.0.0.1 localhost\n')
                    f.writelines('{} {}\n'.format(hosts.address(i), names[i]) for i in range(2))
            agent = tmp_path / 'agent.sh'
            agent.write_text(AGENT.format(cases='\n'.join('  {}) ns={};;'.format(names[i], hosts.namespaces[i])
                                                          for i in range(2))))
            agent.chmod(agent.stat().st_mode | stat.S_IEXEC)
            hosts.agent, hosts.names = str(agent), names
            yield hosts
        finally:
            for folder in etc:
                shutil.rmtree(folder, ignore_errors=True)


def _mpirun(hosts, script, *args, env=None, cwd=None):
    subnet = hosts.address(0).rsplit('.', 1)[0] + '.0/24'  # each host has its own link name: name the subnet
    command = [MPIRUN, '-H', 'node1,node2', '-np', '2', '--mca', 'plm_rsh_agent', hosts.agent,
               '--mca', 'btl', 'self,tcp', '--mca', 'btl_tcp_if_include', subnet,
               '--mca', 'oob_tcp_if_include', subnet,
               '--bind-to', 'none', sys.executable, script, *args]
    inner = ' '.join("'{}'".format(part) for part in command)
    return run_command(hosts.command(0, ['unshare', '--uts', 'sh', '-c', 'hostname node1; exec ' + inner]),
                       timeout=RUN_TIMEOUT, env=env, cwd=cwd)


def _env(**extra):
    env = child_env(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1', OMP_NUM_THREADS='1', **extra)
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURM_PROCID', 'SLURM_NTASKS'):
        env.pop(name, None)
    return env


def _without_mpi4py(tmp_path):
    shadow = tmp_path / 'no_mpi4py' / 'mpi4py'
    shadow.mkdir(parents=True)
    (shadow / '__init__.py').write_text("raise ImportError('mpi4py hidden by the test')\n")
    return _env(PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get('PYTHONPATH', '')]))


def test_without_mpi4py_every_rank_says_to_pass_an_address_within_seconds(cluster, tmp_path):
    started = time.monotonic()
    meet = 120  # a rendezvous timeout that a wait would show, however loaded the machine
    result = _mpirun(cluster, EXAMPLE, '--epochs', '1', '--rendezvous-timeout', str(meet),
                     env=_without_mpi4py(tmp_path), cwd=str(tmp_path))
    elapsed = time.monotonic() - started
    print('mpirun without mpi4py: exit {} after {:.1f} s\n{}'.format(result.returncode, elapsed, result.stderr))
    assert result.returncode != 0
    for rank in (0, 1):
        assert re.search(r'^error: rank {} of 2: mpirun started the job on several machines \(1 of its ranks here\) '
                         r'and gives no address of rank 0; pass --host ADDR or set MASTER_ADDR on every rank, '
                         r'e\.g\. mpirun -x MASTER_ADDR=ADDR'.format(rank), result.stderr, re.M), result.stderr
    assert elapsed < 2 * STARTUP + LOAD_SLACK < meet  # mpirun's start, then the ranks'; never the rendezvous timeout


@pytest.mark.parametrize('script, args, done', [
    (EXAMPLE, ('--epochs', '1', '--download', 'never', '--threads', '1'), r'^epoch 1/1: loss [\d.]+ acc'),
    (OWN_SCRIPT, ('--epochs', '1'), r'^epochs 1: loss [\d.]+ acc'),
], ids=['example', 'own_script'])
def test_with_mpi4py_rank_zeros_address_travels_through_mpi_and_the_job_trains(cluster, tmp_path, script, args,
                                                                                done):
    pytest.importorskip('mpi4py', reason='needs mpi4py (pip install mpi4py)')
    started = time.monotonic()
    result = _mpirun(cluster, script, *args, env=_env(), cwd=str(tmp_path))
    print('mpirun {}: exit {} after {:.1f} s\n{}{}'.format(os.path.basename(script), result.returncode,
                                                           time.monotonic() - started, result.stdout, result.stderr))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(re.findall(done, result.stdout, re.M)) == 1, result.stdout  # printed once, by rank 0
