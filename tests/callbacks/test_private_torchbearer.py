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
from torchbearer.callbacks import Best, MostRecent
from torchbearer.callbacks.aggregate_predictions import AggregatePredictions
from torchbearer.callbacks.printer import Tqdm
from torchbearer.callbacks.torch_scheduler import StepLR
from torchbearer.metrics import EpochLambda, Mean, Std, Var

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
        callbacks = state[torchbearer.CALLBACK_LIST]
        while _torchbearer.injected(callbacks) is not None:  # predict injects a printer, then the collector
            self.injected.append(type(_torchbearer.injected(callbacks)))
            callbacks = callbacks.callback_list

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
