"""Where rank 0 is, under srun and mpirun with no address given: SLURM host lists, job-id ports, loopback.

The host-list parser is compared with ``scontrol show hostnames`` itself where SLURM is installed.
"""
import os
import shutil
import subprocess

import pytest

from torchbearer_dist.runtime import _mpi
from torchbearer_dist.runtime._slurm import hostnames, tasks_per_node
from torchbearer_dist.runtime.env import resolve

SCONTROL = shutil.which('scontrol')

HOSTLISTS = [
    'node[01-04,07]', 'a[1-2],b[3-4]', 'n[8-11]', 'n[08-11]', 'n[1-010]', 'n[009-011]', 'n[01-2]', 'n[1-02]',
    'n[99-101]', 'x,y,x', 'host', 'a b', 'n[5,3,1]', 'n[1-2],,m', 'n[00-02]', '[1-2]', 'node01-ib',
    'rack1-node[01-02],rack2-node[01-02]', 'a[1-2]b[3-4]', 'n[1-3,5-6]x[1-2]', 'n[1-2]-[3-4]', 'gpu[1-2]-ib[1]',
    'a[1-2]b[3-4]c[5-6]', 'a[1-3]b[4-5]c[6-7]', 'a[1-2]b[3-4]c[5-6]d[7-8]', 'a[1-2],b[1-2]c[3-4]d[5-6]',
]
SLURM_CONF = '''\
ClusterName=hostlists
SlurmctldHost=localhost
AuthType=auth/none
CredType=cred/none
NodeName=localhost CPUs=1
PartitionName=p Nodes=localhost
'''


@pytest.fixture(scope='module')
def scontrol_hostnames(tmp_path_factory):
    if SCONTROL is None:
        pytest.skip('scontrol is not installed (Debian: apt-get install -y slurm-wlm)')
    conf = tmp_path_factory.mktemp('slurm') / 'slurm.conf'
    conf.write_text(SLURM_CONF)  # scontrol needs a configuration even to expand a host list offline
    environ = dict(os.environ, SLURM_CONF=str(conf))

    def expand(hostlist):
        result = subprocess.run([SCONTROL, 'show', 'hostnames', hostlist], capture_output=True, text=True,
                                timeout=20, env=environ)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout.split()
    return expand


@pytest.mark.parametrize('hostlist', HOSTLISTS)
def test_host_lists_expand_exactly_as_scontrol_show_hostnames(hostlist, scontrol_hostnames):
    assert hostnames(hostlist) == scontrol_hostnames(hostlist)


def test_a_suffix_after_the_last_bracket_is_kept():
    # SLURM 22.05's scontrol rejects this form; newer releases write it for nodes named gpu1-ib, gpu2-ib.
    assert hostnames('gpu[1-2]-ib,cpu[01-02]') == ['gpu1-ib', 'gpu2-ib', 'cpu01', 'cpu02']


@pytest.mark.parametrize('hostlist, bad', [('n[3-1]', "'3-1'"), ('n[a-b]', "'a-b'"), ('n[]', "''"),
                                           ('n[1-2', 'unbalanced')])
def test_a_malformed_host_list_is_named(hostlist, bad):
    with pytest.raises(ValueError, match=r"SLURM host list '{}' .*{}".format(hostlist.replace('[', r'\['), bad)):
        hostnames(hostlist)


def test_tasks_per_node_expand():
    assert tasks_per_node('2(x3),1') == [2, 2, 2, 1]
    assert tasks_per_node('bad') == []


def _srun(**extra):
    environ = {'SLURM_PROCID': '1', 'SLURM_NTASKS': '2', 'SLURM_LOCALID': '0', 'SLURM_NODEID': '1',
               'SLURM_STEP_NUM_NODES': '2', 'SLURM_STEP_NODELIST': 'node[07-08]', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)',
               'SLURM_JOB_ID': '1234567'}
    environ.update(extra)
    return environ


def test_srun_on_several_nodes_meets_at_the_first_node_on_a_port_from_the_job_id():
    env = resolve(backend='gloo', environ=_srun())
    assert (env.source, env.rank, env.world_size, env.local_world_size) == ('slurm', 1, 2, 1)
    assert (env.host, env.port) == ('node07', 15000 + 4567)


def test_master_addr_and_master_port_win_over_the_node_list():
    env = resolve(backend='gloo', environ=_srun(MASTER_ADDR='10.1.2.3', MASTER_PORT='23456'))
    assert (env.host, env.port) == ('10.1.2.3', 23456)
    env = resolve(backend='gloo', environ=_srun(MASTER_PORT='23456'))
    assert (env.host, env.port) == ('node07', 23456)


def test_srun_on_one_node_meets_on_loopback():
    env = resolve(backend='gloo', environ=_srun(SLURM_STEP_NUM_NODES='1', SLURM_STEP_NODELIST='node07',
                                                SLURM_NODEID='0', SLURM_STEP_TASKS_PER_NODE='2'))
    assert (env.host, env.local_world_size) == ('127.0.0.1', 2)
    assert env.port == 15000 + 4567  # the job's: two jobs of several tasks on one node met on 29500 (helper)


def test_srun_on_several_nodes_told_to_meet_at_loopback_fails_at_once():
    with pytest.raises(RuntimeError, match=r'^rank 1 of 2 runs on a machine with 1 of the job\'s ranks \(srun says '
                                           r'so\) but was told to meet rank 0 at 127\.0\.0\.1:15000, a loopback'):
        resolve(backend='gloo', environ=_srun(MASTER_ADDR='127.0.0.1', MASTER_PORT='15000'))


def _mpirun(**extra):
    environ = {'OMPI_COMM_WORLD_RANK': '0', 'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_LOCAL_RANK': '0',
               'OMPI_COMM_WORLD_LOCAL_SIZE': '1'}
    environ.update(extra)
    return environ


def test_mpirun_across_hosts_without_an_address_or_mpi4py_names_the_fix(monkeypatch):
    monkeypatch.setattr(_mpi, 'address', lambda port: None)  # as where mpi4py is not installed
    with pytest.raises(RuntimeError, match=r'^rank 0 of 2: mpirun started the job on several machines \(1 of its '
                                           r'ranks here\) and gives no address of rank 0; pass --host ADDR or set '
                                           r'MASTER_ADDR on every rank, e\.g\. mpirun -x MASTER_ADDR=ADDR .*mpi4py'):
        resolve(backend='gloo', environ=_mpirun())


def test_mpirun_across_hosts_with_a_loopback_host_fails_at_once():
    with pytest.raises(RuntimeError, match=r'told to meet rank 0 at localhost:29500, a loopback address'):
        resolve(host='localhost', backend='gloo', environ=_mpirun())


def test_mpirun_across_hosts_with_an_address_resolves_without_mpi():
    env = resolve(backend='gloo', environ=_mpirun(MASTER_ADDR='10.1.2.3'))
    assert (env.host, env.port, env.local_world_size) == ('10.1.2.3', 29500, 1)


def test_mpirun_on_one_host_keeps_loopback():
    env = resolve(backend='gloo', environ=_mpirun(OMPI_COMM_WORLD_LOCAL_SIZE='2'))
    assert (env.host, env.source) == ('127.0.0.1', 'openmpi')


def test_only_a_port_that_answers_is_blamed_on_another_program():
    import socket

    from torchbearer_dist.runtime._peers import probe
    from torchbearer_dist.runtime.launcher import free_port
    with socket.socket() as listener:
        listener.bind(('127.0.0.1', 0))
        listener.listen(1)
        assert probe('127.0.0.1', listener.getsockname()[1]) == 'ok'
    assert probe('127.0.0.1', free_port()) == 'refused'
