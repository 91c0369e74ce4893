"""Canary: the torchbearer internals ``torchbearer_dist/_torchbearer.py`` reads are where it reads them.

Fails on the pinned torchbearer if a release moved one; the package then warns once at run time,
naming the guarantee lost. One process, no process group.
"""
import warnings

import torch
import torchbearer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchbearer import Callback, Trial
from torchbearer.callbacks import Best, CallbackList, MostRecent
from torchbearer.callbacks.aggregate_predictions import AggregatePredictions
from torchbearer.callbacks.printer import Tqdm
from torchbearer.callbacks.torch_scheduler import StepLR
from torchbearer.metrics import EpochLambda, Mean, Std, Var
from torchbearer.trial import CallbackListInjection

from torchbearer_dist import _once, _torchbearer


def test_checkpointers_share_the_private_base():
    assert _torchbearer.checkpointer_types(), 'torchbearer.callbacks.checkpointers._Checkpointer moved'
    assert isinstance(MostRecent('x.pt'), _torchbearer.checkpointer_types())
    assert isinstance(Best('x.pt'), _torchbearer.checkpointer_types())


def test_metric_settings_are_where_the_aggregators_read_them():
    assert _torchbearer.mean_dim(Mean('m', dim=0)) == 0 and _torchbearer.mean_dim(Mean('m')) is None
    assert _torchbearer.var_unbiased(Var('v', unbiased=False)) is False
    assert _torchbearer.var_unbiased(Std('s')) is True


def test_epoch_lambda_outputs_are_replaced_before_its_function_runs():
    seen = []
    node = EpochLambda('n', lambda y_pred, y_true: seen.append((y_pred.tolist(), y_true.tolist())) or 0.0,
                       running=False)
    node.reset({torchbearer.DEVICE: 'cpu'})
    node.eval()  # validation: outputs are only collected
    node.process({torchbearer.Y_PRED: torch.tensor([1.0]), torchbearer.Y_TRUE: torch.tensor([0.0]),
                  torchbearer.DEVICE: 'cpu'})
    assert _torchbearer.gather_epoch_outputs(node, lambda rows: torch.cat([rows, rows + 10]))
    node.process_final({torchbearer.DEVICE: 'cpu'})
    assert seen == [([1.0, 11.0], [0.0, 10.0])]


class _Seen(Callback):
    def __init__(self):
        super().__init__()
        self.injected, self.scheduler = [], None

    def on_start(self, state):
        # predict injects a printer, then the collector
        self.injected += [type(c) for c in _torchbearer.injections(state[torchbearer.CALLBACK_LIST])]

    def on_end(self, state):
        for callback in self.trial_callbacks:
            self.scheduler = self.scheduler or _torchbearer.torch_scheduler(callback)


def test_injected_printer_and_collector_and_the_scheduler_are_found():
    seen = _Seen()
    model = nn.Linear(2, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                  callbacks=[StepLR(step_size=1), seen], verbose=0)
    seen.trial_callbacks = trial.state[torchbearer.CALLBACK_LIST].callback_list
    trial.with_generators(train_generator=DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)),
                                                     batch_size=2))
    _once._given.clear()
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # any lost-internal warning fails the test
        trial.run(1, verbose=1)
        trial.predict(data_key=torchbearer.TRAIN_DATA, verbose=0)
    assert seen.injected == [Tqdm, Callback, AggregatePredictions]  # run's bar; predict's silent printer, collector
    assert isinstance(seen.scheduler, torch.optim.lr_scheduler.StepLR)


class _Last(Callback):
    """Appended to the Trial's list inside the run: the list torchbearer calls is the one edited."""

    def __init__(self, order):
        super().__init__()
        self.order = order

    def on_step_training(self, state):
        self.order.append('last')


class _Editor(Callback):
    def __init__(self):
        super().__init__()
        self.order, self.bar = [], None

    def on_start(self, state):
        printer = _torchbearer.injected(state[torchbearer.CALLBACK_LIST])  # run(verbose=1)'s per-epoch bar
        self.bar = printer._loader
        _torchbearer.close_bar(printer)

    def on_start_training(self, state):
        _torchbearer.callback_list(state[torchbearer.CALLBACK_LIST]).append(_Last(self.order))

    def on_step_training(self, state):
        self.order.append('editor')


def test_the_callback_list_a_run_calls_is_the_one_edited_and_the_epoch_bar_is_closed():
    editor = _Editor()
    model = nn.Linear(2, 1)
    trial = Trial(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), callbacks=[editor], verbose=0)
    trial.with_generators(train_generator=DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)),
                                                     batch_size=2))
    _once._given.clear()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        trial.run(1, verbose=1)  # injects a Tqdm printer in front of the Trial's list
    assert editor.order == ['editor', 'last', 'editor', 'last']
    assert editor.bar is not None and editor.bar.leave is False and editor.bar.disable  # tqdm's closed state


def _moved(call, match):
    """Run ``call`` as on a torchbearer that moved an internal: one RuntimeWarning naming the guarantee lost."""
    _once._given.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        first, second = call(), call()
    lost = [w for w in caught if match in str(w.message)]
    assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning), [str(w.message) for w in caught]
    return first, second


def test_each_moved_internal_warns_once_naming_the_guarantee_lost():
    moved = CallbackList([])
    moved.callback_list = ()  # not a list: the structure moved
    first, _ = _moved(lambda: _torchbearer.callback_list(moved), 'a stop asked on one rank')
    assert first == [] and first is not moved.callback_list
    injection = CallbackListInjection(Callback(), CallbackList([]))
    del injection.callback
    assert _moved(lambda: _torchbearer.injected(injection), 'predictions are not gathered') == (None, None)
    printer = Tqdm()
    del printer._loader
    _moved(lambda: _torchbearer.close_bar(printer), "run(verbose=1)'s per-epoch bar stays")


def test_a_run_leaves_its_last_loader_in_the_trials_state_which_forget_loader_clears():
    # The fault-tolerant mode tells run() from evaluate()/predict() at on_start by state[GENERATOR]: they set it
    # first, run() does not, but torchbearer leaves the last pass's loader there.
    seen = []

    class Start(Callback):
        def on_start(self, state):
            seen.append(state.get(torchbearer.GENERATOR))

        def on_end(self, state):
            if len(seen) == 2:  # after the second run only: the first run's loader stays for the check below
                _torchbearer.forget_loader(state)

    net = nn.Linear(2, 1)
    loader = DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)
    trial = Trial(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), callbacks=[Start()])
    trial.with_generators(loader, val_generator=loader)
    trial.run(1, verbose=0)
    trial.run(2, verbose=0)  # the first run's last loader, left in state, is what on_start finds
    trial.run(3, verbose=0)  # forgotten after the second
    trial.evaluate(verbose=0)  # evaluate() sets its own first
    assert [g is not None for g in seen] == [False, True, False, True]
