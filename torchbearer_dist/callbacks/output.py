"""Rank-0 I/O: progress bars, printing, logging and checkpoints on global rank 0 only."""
import torchbearer
from torchbearer import Callback
from torchbearer.callbacks import CallbackList, ConsolePrinter, CSVLogger, Tqdm

from torchbearer_dist import _torchbearer
from torchbearer_dist.sync import collectives


class _Silent(Callback):
    def __init__(self, callback):
        super().__init__()
        self.silenced = callback

    def state_dict(self):
        return self.silenced.state_dict()

    def load_state_dict(self, state_dict):
        self.silenced.load_state_dict(state_dict)
        return self

    def __str__(self):
        return 'silenced on this rank: {}'.format(self.silenced)


def _output_types():
    return (Tqdm, ConsolePrinter, CSVLogger) + _torchbearer.checkpointer_types()


def _silence(callbacks):
    listed = _torchbearer.callback_list(callbacks)
    for i, callback in enumerate(listed):
        if isinstance(callback, CallbackList):
            _silence(callback)
        elif isinstance(callback, _output_types()) or isinstance(callback, RankZeroOnly):
            listed[i] = _Silent(callback)


class RankZeroOutput(Callback):
    """Print, log and save on global rank 0 only.

    On the other ranks it sets the Trial's ``verbose`` to 0, turns off the progress bar that a
    ``verbose=`` given to ``run``, ``evaluate`` or ``predict`` injects (the per-epoch bar of
    ``run(verbose=1)`` starts before any callback can act: its first line is erased at once; give
    ``verbose`` to the Trial instead to have none), and
    silences the Trial's printers (Tqdm, ConsolePrinter), CSVLogger and checkpointers. Because
    metrics are global, rank 0's checkpoint decisions are every rank's, and all ranks carry on together.

    Example: ::

        >>> from torchbearer_dist import RankZeroOutput
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[RankZeroOutput()])

    State Requirements:
        - :attr:`torchbearer.state.SELF`: the Trial, whose ``verbose`` is set to 0 on ranks > 0
    """

    def on_init(self, state):
        self._silence(state)

    def on_start(self, state):
        # Also here: the process group may have come up after the Trial was built.
        self._silence(state)
        if collectives.rank() == 0:
            return
        callbacks = state[torchbearer.CALLBACK_LIST]
        printer = _torchbearer.injected(callbacks)
        if isinstance(printer, _output_types()):
            # The printer run, evaluate or predict injected for a verbose= passed to them. A per-batch
            # bar starts later, in on_start_training or on_start_validation: it never draws. Only the
            # per-epoch bar of run(verbose=1) drew, in its own on_start before this one (its first line,
            # and after a resume the last epoch's metrics): that line is erased, and it draws no more.
            _torchbearer.close_bar(printer)
            _torchbearer.replace_injected(callbacks, _Silent(printer))

    @staticmethod
    def _silence(state):
        """Ranks > 0: turn off the Trial's printers and writers, through torchbearer's public switches.

        ``Trial.verbose = 0`` is the verbosity that ``run``, ``evaluate`` and ``predict`` use unless
        given their own ``verbose=``; the output callbacks in the list are replaced by inert stand-ins
        that keep their ``state_dict``. Nothing of the Trial itself is replaced.
        """
        if collectives.rank() == 0:
            return
        trial = state[torchbearer.SELF]
        trial.verbose = 0
        _silence(trial.state[torchbearer.CALLBACK_LIST])  # the Trial's own list, under any injection


class RankZeroOnly(Callback):
    """Run any callback on global rank 0 only, e.g. a logger or a custom printer.

    Example: ::

        >>> from torchbearer.callbacks import TensorBoard
        >>> from torchbearer_dist import RankZeroOnly
        >>> logger = RankZeroOnly(TensorBoard())

    Args:
        callback (torchbearer.callbacks.Callback): the callback to run on rank 0
    """

    def __init__(self, callback):
        super().__init__()
        self.callback = callback

    def __getattribute__(self, name):
        if name.startswith('on_') and collectives.rank() == 0:
            return getattr(object.__getattribute__(self, 'callback'), name)
        return object.__getattribute__(self, name)

    def state_dict(self):
        return self.callback.state_dict()

    def load_state_dict(self, state_dict):
        self.callback.load_state_dict(state_dict)
        return self
