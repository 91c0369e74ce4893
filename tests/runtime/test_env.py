"""Who am I: values from arguments, torchrun and SLURM, checked before any socket opens; file:// rendezvous."""
import json
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torchbearer_dist
from torchbearer_dist.runtime import rendezvous
from torchbearer_dist.runtime.env import DistEnv, resolve, with_rendezvous_timeout

from _dist import child_env, python, run_command

BAD_ARGUMENTS = [
    (dict(rank=-1, world_size=2), r'rank should be between 0 and 1 \(world_size - 1\), but given -1; give each '
                                  r'process a distinct rank in that range'),
    (dict(rank=2, world_size=2), r'rank should be between 0 and 1 \(world_size - 1\), but given 2'),
    (dict(rank=0, world_size=0), r'world_size should be at least 1, but given 0; pass the number of processes'),
    (dict(rank=0, world_size=-3), r'world_size should be at least 1, but given -3'),
    (dict(rank='1a', world_size=2), r"rank should be an integer, but given '1a'; pass --rank as a whole number"),
    (dict(rank=1.5, world_size=2), r'rank should be an integer, but given 1.5'),
    (dict(rank=0, world_size=True), r'world_size should be an integer, but given True; pass --world-size'),
    (dict(rank=0, world_size=2, port=0), r'port should be between 1 and 65535, but given 0; pass a free port '
                                         r'with --port'),
    (dict(rank=0, world_size=2, port=70000), r'port should be between 1 and 65535, but given 70000'),
    (dict(rank=0, world_size=2, port='http'), r"port should be an integer, but given 'http'"),
    (dict(rank=0, world_size=2, backend='foo'), r"backend should be one of gloo, nccl, mpi, but given 'foo'; use "
                                                r"gloo on CPUs and nccl on GPUs"),
    (dict(rank=0, world_size=2, timeout=-1), r'timeout should be positive, but given -1.0 s; pass e.g. timeout=60'),
    (dict(rank=0, world_size=2, timeout=0), r'timeout should be positive, but given 0.0 s'),
    (dict(rank=0, world_size=2, timeout='soon'), r"timeout should be a number of seconds or a datetime.timedelta, "
                                                 r"but given 'soon'"),
    (dict(rank=0, world_size=2, init_method='http://host:1'), r"init_method should be 'file:///path', 'env://' or "
                                                              r"'tcp://host:port', but given 'http://host:1'"),
    (dict(rank=0, world_size=2, init_method='file://'), r"init_method 'file://' names no file; use "
                                                        r"'file:///shared/dir/rendezvous'"),
    (dict(rank=0, world_size=2, init_method='tcp://10.0.0.1:99999'), r'port should be between 1 and 65535, but '
                                                                     r'given 99999'),
    (dict(rank=0, world_size=2, host=' '), r"host should be the address of rank 0, but given ' '; pass --host ADDR"),
    (dict(rank=0, world_size=2, local_rank=-1), r'local_rank should be >= 0, but given -1'),
    (dict(rank=1), r'world_size is missing: pass --world-size N \(the number of processes\) or set WORLD_SIZE'),
]

BAD_ENVIRONMENTS = [
    ({'RANK': 'x', 'WORLD_SIZE': '2'}, r"Environment variable RANK should be an integer, but given 'x'; fix or "
                                       r"unset it"),
    ({'RANK': '2', 'WORLD_SIZE': '2'}, r'rank should be between 0 and 1 \(world_size - 1\), but given 2'),
    ({'WORLD_SIZE': '2'}, r'rank is missing: pass --rank i with 0 <= i < 2 or set RANK'),
    ({'SLURM_PROCID': '4', 'SLURM_NTASKS': '4'}, r'rank should be between 0 and 3 \(world_size - 1\), but given 4'),
    ({'RANK': '0', 'WORLD_SIZE': '2', 'MASTER_PORT': '0x10'}, r"Environment variable MASTER_PORT should be an "
                                                              r"integer, but given '0x10'"),
    ({'TORCHBEARER_DIST_TIMEOUT': 'never'}, r"TORCHBEARER_DIST_TIMEOUT should be a number of seconds, but given "
                                            r"'never'; fix or unset it"),
]


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if init_process_group gets as far as the network."""
    def tripwire(*args, **kwargs):
        raise AssertionError('init_process_group reached the network before rejecting a bad value')
    monkeypatch.setattr(rendezvous, '_make_store', tripwire)


@pytest.mark.parametrize('kwargs, message', BAD_ARGUMENTS)
def test_bad_argument_raises_its_value_error(kwargs, message, no_network):
    with pytest.raises(ValueError, match=message):
        resolve(environ={}, **kwargs)
    with pytest.raises(ValueError, match=message):
        torchbearer_dist.init_process_group(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize('environ, message', BAD_ENVIRONMENTS)
def test_bad_environment_raises_its_value_error(environ, message, no_network, monkeypatch):
    with pytest.raises(ValueError, match=message):
        resolve(environ=environ)
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURM_PROCID', 'SLURM_NTASKS',
                 'SLURM_LOCALID', 'TORCHBEARER_DIST_TIMEOUT'):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        torchbearer_dist.init_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has CUDA')
def test_nccl_without_cuda_is_refused(no_network):
    message = r"backend 'nccl' needs a CUDA device, but this process sees none; use backend='gloo' on CPU machines"
    with pytest.raises(ValueError, match=message):
        resolve(rank=0, world_size=2, backend='nccl', environ={})
    with pytest.raises(ValueError, match=message):
        torchbearer_dist.init_process_group(rank=0, world_size=2, backend='NCCL')


def test_explicit_arguments():
    env = resolve(rank=1, world_size=2, host='10.0.0.1', port='1234', backend='GLOO', timeout=5, environ={})
    assert env == DistEnv(rank=1, world_size=2, local_rank=1, host='10.0.0.1', port=1234, backend='gloo',
                          timeout=timedelta(seconds=5), init_method=None, source='arguments')
    assert env.address == '10.0.0.1:1234'


def test_explicit_arguments_win_over_the_environment():
    environ = {'RANK': '1', 'WORLD_SIZE': '4', 'MASTER_ADDR': '10.0.0.9', 'MASTER_PORT': '4000'}
    env = resolve(rank=0, world_size=2, host='127.0.0.1', port=5000, backend='gloo', environ=environ)
    assert (env.rank, env.world_size, env.host, env.port, env.source) == (0, 2, '127.0.0.1', 5000, 'arguments')


def test_torchrun_environment():
    environ = {'RANK': '3', 'WORLD_SIZE': '4', 'LOCAL_RANK': '1', 'MASTER_ADDR': '10.1.2.3', 'MASTER_PORT': '29600',
               'SLURM_PROCID': '0', 'SLURM_NTASKS': '8'}
    env = resolve(backend='gloo', environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.host, env.port, env.source) == (
        3, 4, 1, '10.1.2.3', 29600, 'torchrun')


def test_slurm_environment():
    environ = {'SLURM_PROCID': '5', 'SLURM_NTASKS': '8', 'SLURM_LOCALID': '1', 'MASTER_ADDR': 'node01'}
    env = resolve(backend='gloo', environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.host, env.port, env.source) == (
        5, 8, 1, 'node01', 29500, 'slurm')


def test_nothing_given_is_a_job_of_one():
    env = resolve(environ={})
    assert (env.rank, env.world_size, env.local_rank, env.host, env.source) == (0, 1, 0, '127.0.0.1', 'default')


def test_init_methods():
    env = resolve(rank=0, world_size=2, backend='gloo', init_method='tcp://10.0.0.2:2345', environ={})
    assert (env.host, env.port, env.init_method) == ('10.0.0.2', 2345, None)
    env = resolve(rank=0, world_size=2, backend='gloo', init_method='env://', environ={'MASTER_PORT': '2346'})
    assert (env.port, env.init_method) == (2346, None)
    env = resolve(rank=0, world_size=2, backend='gloo', init_method='file:///shared/rendezvous', environ={})
    assert env.init_method == 'file:///shared/rendezvous'


def test_two_timeouts_a_long_collective_one_and_a_short_rendezvous():
    assert torchbearer_dist.DEFAULT_TIMEOUT == timedelta(minutes=30)  # torch's own default for gloo
    assert torchbearer_dist.DEFAULT_RENDEZVOUS_TIMEOUT == timedelta(seconds=60)
    env = with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', environ={}), environ={})
    assert (env.timeout, env.rendezvous_timeout) == (timedelta(minutes=30), timedelta(seconds=60))
    env = with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', timeout=7, environ={}), environ={})
    assert env.rendezvous_timeout == timedelta(seconds=7)  # never longer than the collective timeout by default
    env = with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', environ={}), 5, environ={})
    assert env.rendezvous_timeout == timedelta(seconds=5)
    environ = {'TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT': '2.5'}
    assert with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', environ={}),
                                   environ=environ).rendezvous_timeout == timedelta(seconds=2.5)
    with pytest.raises(ValueError, match=r'^rendezvous_timeout should be positive, but given -1.0 s; pass e.g. '
                                         r'rendezvous_timeout=60$'):
        with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', environ={}), -1, environ={})
    with pytest.raises(ValueError, match=r"^TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT should be a number of seconds, but "
                                         r"given 'soon'; fix or unset it$"):
        with_rendezvous_timeout(resolve(rank=0, world_size=2, backend='gloo', environ={}),
                                environ={'TORCHBEARER_DIST_RENDEZVOUS_TIMEOUT': 'soon'})


def test_default_timeout_can_be_set():
    assert resolve(rank=0, world_size=2, backend='gloo', environ={}).timeout == torchbearer_dist.DEFAULT_TIMEOUT
    assert resolve(rank=0, world_size=2, backend='gloo', environ={'TORCHBEARER_DIST_TIMEOUT': '7.5'}).timeout == \
        timedelta(seconds=7.5)
    assert resolve(rank=0, world_size=2, backend='gloo', timeout=timedelta(seconds=3), environ={}).timeout == \
        timedelta(seconds=3)


def test_process_group_gets_the_default_timeout(monkeypatch):
    monkeypatch.delenv('TORCHBEARER_DIST_TIMEOUT', raising=False)
    with torchbearer_dist.process_group(rank=0, world_size=1, backend='gloo') as env:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu'))
        assert env.timeout == backend.options._timeout == torchbearer_dist.DEFAULT_TIMEOUT
    assert not dist.is_initialized()


RANK_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    import torchbearer_dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    before = dict(os.environ)
    with torchbearer_dist.process_group(rank=rank, world_size=2, init_method='file://' + path, backend='gloo',
                                        timeout=20) as env:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        inside = os.environ.get('GLOO_SOCKET_IFNAME')
        gloo = torchbearer_dist.runtime.env._live.gloo
    print(json.dumps({'rank': env.rank, 'total': total.item(), 'ifname': inside, 'gloo_on': sorted(set(
        ip for ip, _ in gloo)), 'timeout': env.timeout.total_seconds(), 'leaked': sorted(
        set(os.environ.items()) ^ set(before.items()))}))
''')


@pytest.mark.slow
def test_two_ranks_meet_through_a_file(tmp_path):
    script = tmp_path / 'rank.py'
    script.write_text(RANK_SCRIPT)
    rendezvous_file = tmp_path / 'rendezvous'
    ranks = ' '.join('"$@" {} {} > {} 2>&1 & pids="$pids $!";'.format(rank, rendezvous_file, tmp_path / str(rank))
                     for rank in range(2))
    command = ['sh', '-c', 'pids=; {} status=0; for p in $pids; do wait $p || status=1; done; exit $status'.format(
        ranks), 'sh', *python(str(script))]
    env = child_env()
    env.pop('GLOO_SOCKET_IFNAME', None)
    for name in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RUN_ID'):
        env.pop(name, None)
    result = run_command(command, timeout=60, env=env)
    outputs = [(tmp_path / str(rank)).read_text() for rank in range(2)]
    assert result.returncode == 0, outputs
    reports = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    # gloo was put on loopback (the route to the master) without GLOO_SOCKET_IFNAME being left behind
    assert reports == [{'rank': rank, 'total': 3.0, 'ifname': None, 'gloo_on': ['127.0.0.1'], 'timeout': 20.0,
                        'leaked': []} for rank in range(2)]


# Launchers and the backend choice (issue 10).

def test_openmpi_environment():
    environ = {'OMPI_COMM_WORLD_RANK': '3', 'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_COMM_WORLD_LOCAL_RANK': '1',
               'SLURM_PROCID': '0', 'SLURM_NTASKS': '1'}  # mpirun inside an allocation: its variables win
    env = resolve(host='10.0.0.1', backend='gloo', environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.host, env.source) == (3, 4, 1, '10.0.0.1', 'openmpi')


def test_mpich_pmi_environment():
    environ = {'PMI_RANK': '1', 'PMI_SIZE': '2', 'MPI_LOCALRANKID': '0'}
    env = resolve(backend='gloo', environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 0, 'pmi')


def test_torchrun_wins_over_mpi():
    environ = {'RANK': '1', 'WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '0', 'OMPI_COMM_WORLD_SIZE': '4'}
    assert resolve(backend='gloo', environ=environ).source == 'torchrun'


def test_bad_openmpi_variable_is_named():
    with pytest.raises(ValueError, match=r"^Environment variable OMPI_COMM_WORLD_SIZE should be an integer, but "
                                         r"given 'two'; fix or unset it$"):
        resolve(backend='gloo', environ={'OMPI_COMM_WORLD_RANK': '0', 'OMPI_COMM_WORLD_SIZE': 'two'})


@pytest.mark.parametrize('device, cuda_available, expected', [
    (None, False, 'gloo'),
    (None, True, 'gloo'),  # a GPU in the machine is no reason for nccl
    (torch.nn.Linear(2, 1), True, 'gloo'),  # a model on the CPU
    ('cpu', True, 'gloo'),
    ('cuda:0', True, 'nccl'),
    (torch.device('cuda', 1), True, 'nccl'),
    ('cuda:0', False, 'gloo'),
    (torch.nn.Linear(2, 1).to('meta'), True, 'gloo'),
])
def test_default_backend_follows_the_model_not_the_machine(device, cuda_available, expected):
    assert torchbearer_dist.runtime.backends.default_backend(device, cuda_available=cuda_available) == expected


def test_launch_and_process_group_default_to_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # as on a GPU machine; torch.distributed untouched
    assert resolve(rank=0, world_size=2, environ={}).backend == 'gloo'
    with torchbearer_dist.process_group(rank=0, world_size=1) as env:
        assert env.backend == 'gloo' and dist.get_backend() == 'gloo'
