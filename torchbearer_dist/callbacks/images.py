"""Flatten image batches for models that take vectors."""
import torchbearer
from torchbearer import Callback

from torchbearer_dist.callbacks.gradients import SKIPPED_STEPS, AllReduceGradients  # noqa: F401 (re-exported)


class FlattenImages(Callback):
    """Reshape each batch of inputs to ``(batch, -1)``, in training, validation and test alike.

    Example: ::

        >>> from torchbearer_dist import FlattenImages
        >>> trial = Trial(torch.nn.Linear(784, 10), callbacks=[FlattenImages()])

    State Requirements:
        - :attr:`torchbearer.state.X`: the input batch
    """

    @staticmethod
    def _flatten(state):
        x = state[torchbearer.X]
        state[torchbearer.X] = x.reshape(x.size(0), -1)

    def on_sample(self, state):
        self._flatten(state)

    def on_sample_validation(self, state):
        self._flatten(state)
