"""Where an epoch's training time goes: :class:`CommunicationReport`, a line on rank 0 and figures in the history.

The counters live in the engines (:meth:`GradientBuckets.traffic
<torchbearer_dist.sync.buckets.GradientBuckets.traffic>`, PowerSGD's): payload bytes and
``time.perf_counter`` around each wait, nothing per step here but a count. At the end of each epoch
the ranks share their figures in one all-reduce of ``world_size x 6`` numbers.
"""
import math
import time

import torch
import torch.distributed as dist
import torchbearer
from torchbearer import Callback
from torchbearer.callbacks import CallbackList, Tqdm
from tqdm import tqdm

from torchbearer_dist import _torchbearer
from torchbearer_dist.callbacks.gradients import AllReduceGradients
from torchbearer_dist.sync import collectives

#: History key: payload bytes each rank handed to all-reduce in the epoch's training pass.
COMM_BYTES = 'comm_bytes'
#: History key: seconds the training steps waited for communication that backward did not hide.
COMM_WAIT = 'comm_wait_s'
#: History key: the link rate achieved, megabits of payload per second while communication was in flight.
COMM_RATE = 'comm_mbit_s'
#: History key: seconds of the epoch's training pass (the longest rank's).
TRAIN_TIME = 'train_s'
#: History key: the rank that computed longest (time outside communication waits).
SLOWEST_RANK = 'slowest_rank'
#: History key: how many seconds longer the slowest rank computed than the fastest.
SLOWEST_LAG = 'slowest_lag_s'
#: Every history key the report writes.
REPORT_KEYS = (COMM_BYTES, COMM_WAIT, COMM_RATE, TRAIN_TIME, SLOWEST_RANK, SLOWEST_LAG)

_FIELDS = 6  # per rank: train seconds, wait seconds, in-flight seconds, bytes, counted (0 or 1), steps


def _callbacks(callbacks):
    """Every callback in a CallbackList, nested lists and injections opened (public iteration only)."""
    for callback in callbacks:
        if isinstance(callback, CallbackList):
            yield from _callbacks(callback)
        else:
            yield callback


def _counter(callback):
    """The object whose ``traffic()`` counts a callback's communication, or None.

    AllReduceGradients counts through its engine (``buckets``, None until its first training pass);
    any other callback that communicates may offer ``traffic()`` itself, returning
    ``(bytes_sent, wait_seconds, comm_seconds)`` totals, as :meth:`GradientBuckets.traffic
    <torchbearer_dist.sync.buckets.GradientBuckets.traffic>` does (``comm_seconds`` None: not known).
    """
    if isinstance(callback, AllReduceGradients):
        return callback.buckets
    return callback if callable(getattr(callback, 'traffic', None)) else None


def _shows_progress(state):
    """Whether this run prints progress: ``verbose`` 1 or 2 (of ``run`` or else of the Trial), not 0."""
    printer = _torchbearer.injected(state[torchbearer.CALLBACK_LIST])
    if printer is None:
        return getattr(state.get(torchbearer.SELF), 'verbose', 1) != 0
    return isinstance(printer, Tqdm)


def _size(count):
    for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if count >= scale:
            return '{:.2f} {}'.format(count / scale, unit)
    return '{:d} B'.format(int(count))


class CommunicationReport(Callback):
    """Say, once per epoch on rank 0, where the training time went: computing, or waiting for the network.

    At the end of each epoch rank 0 prints one line, and every rank puts the same figures in
    ``state[torchbearer.METRICS]``, so they land in the history ``trial.run()`` returns:

    - ``comm_bytes``: the payload bytes each rank handed to all-reduce during the training pass
      (gradients in their wire dtype, one presence flag per parameter, the stop and control flags; equal on
      every rank). A ring all-reduce moves ``2 (N - 1) / N`` times that over each rank's link in each
      direction: for two ranks, the payload itself.
    - ``comm_wait_s``: the seconds the steps waited for all-reduces once backward had finished, the
      communication that backward did not hide; the least over ranks, so that waiting for a slower
      peer (which is ``slowest_lag_s``) is not counted as the network's.
    - ``comm_mbit_s``: the link rate achieved: payload megabits over the seconds communication was in
      flight (from each step's first all-reduce to the end of its last wait), on the rank that
      waited least; absent where that time is not known (DiLoCo's meetings travel while the ranks compute).
    - ``train_s``: the seconds of the training pass (the longest over ranks), up to the end of every
      callback's ``on_end_training``: DiLoCo's last meeting, at the end of the run's last pass, is
      inside it, as its bytes and waits are inside the others.
    - ``slowest_rank`` and ``slowest_lag_s``: the rank that computed longest (its training time less
      its waits) and by how many seconds it trailed the fastest; every other rank waited that long
      for it.

    The communication figures come from :class:`AllReduceGradients` (fp16, bf16 and PowerSGD
    included) or from any callback in the list that offers ``traffic()``; under
    DistributedDataParallel they are left out and only the time and the slowest rank are reported.
    In a job of one process it does nothing.

    It costs one all-reduce of ``6 x world_size`` numbers per epoch and a counter per step; the
    engines time each wait with ``time.perf_counter``. ``benchmarks/comm_report_cost.py`` measures it.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import CommunicationReport
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[CommunicationReport()])

    Args:
        printed (bool): None (the default): rank 0 prints the line each epoch of a run that shows progress
            (``verbose`` 1 or 2), and nothing in a ``verbose=0`` run; True: rank 0 prints it whatever the
            verbosity; False: never. The history holds the figures in every case.

    Raises:
        ValueError: ``printed`` is not None, True or False

    State Requirements:
        - :attr:`torchbearer.state.CALLBACK_LIST`: searched for the callbacks that communicate
        - :attr:`torchbearer.state.METRICS`: the figures are added at the end of each epoch

    .. warning:: A synchronization point at each epoch's end: every rank must run the same epochs.
    """

    def __init__(self, printed=None):
        super().__init__()
        if printed is not None and not isinstance(printed, bool):
            raise ValueError('printed should be None (follow the Trial\'s verbose), True or False, but given '
                             '{!r}'.format(printed))
        self.printed = printed
        self._began = self._figures = None
        self._before, self._steps = [], 0
        self._show = False

    def on_start(self, state):
        self._began = self._figures = None  # nothing measured yet in this run, evaluate or predict
        self._show = _shows_progress(state) if self.printed is None else self.printed

    def on_end(self, state):
        self._began = self._figures = None

    def _totals(self, state):
        """``(callback, counter, totals)`` for every callback that counts communication."""
        counters = [(callback, _counter(callback)) for callback in _callbacks(state[torchbearer.CALLBACK_LIST])]
        return [(callback, counter, counter.traffic()) for callback, counter in counters if counter is not None]

    def on_start_training(self, state):
        self._figures = None
        if collectives.world_size() == 1:
            self._began = None
            return
        self._before = self._totals(state)
        self._steps = 0
        self._began = time.perf_counter()

    def on_step_training(self, state):
        self._steps += 1

    def _stop_clock(self):
        if self._began is not None:
            self._figures = [time.perf_counter() - self._began]
            self._began = None

    def on_start_validation(self, state):
        # The training pass ends after every callback's on_end_training, whatever the order of the list
        # (DiLoCo's last meeting of the pass runs there): the clock stops at the next event after them.
        if self._figures is None:
            self._stop_clock()

    def on_end_epoch(self, state):
        if self._figures is None:  # an epoch without validation: this is the first event after the pass
            self._stop_clock()
        if self._figures is None:  # no training pass measured (one process, evaluate, predict)
            return
        # The traffic is read here, after every callback's on_end_training: DiLoCo's last outer step of
        # the pass runs there, wherever it sits in the list.
        before = {id(callback): (counter, totals) for callback, counter, totals in self._before}
        sent, waited, flight, counted = 0, 0.0, 0.0, False
        for callback, counter, totals in self._totals(state):
            counted = True
            old_counter, old = before.get(id(callback), (None, None))
            if old_counter is not counter:  # a new engine since the pass began: all of its traffic is this pass's
                old = (0, 0.0, 0.0)
            sent += totals[0] - old[0]
            waited += totals[1] - old[1]
            flight += float('nan') if totals[2] is None else totals[2] - old[2]  # None: not known (DiLoCo)
        figures = self._figures + [waited, flight, float(sent), float(counted), float(self._steps)]
        self._figures = None
        device = collectives.comm_device(torch.device('cpu'))
        table = torch.zeros(collectives.world_size(), _FIELDS, dtype=torch.float64, device=device)
        table[collectives.rank()] = torch.tensor(figures, dtype=torch.float64)
        dist.all_reduce(table)
        rows = table.cpu().tolist()
        report = self.figures(rows)
        state[torchbearer.METRICS].update(report)
        if self._show and collectives.rank() == 0:
            tqdm.write(self.line(report, rows, state[torchbearer.EPOCH], state[torchbearer.MAX_EPOCHS]))

    @staticmethod
    def figures(rows):
        """The report from every rank's row of figures: a pure function, the same on every rank.

        Args:
            rows (list): per rank, ``[train seconds, wait seconds, in-flight seconds, bytes, counted, steps]``

        Returns:
            dict: the history entries, communication ones only where every rank counted its traffic
        """
        busy = [train - wait for train, wait, *_ in rows]
        slowest = max(range(len(rows)), key=lambda r: busy[r])
        report = {TRAIN_TIME: max(row[0] for row in rows), SLOWEST_RANK: slowest,
                  SLOWEST_LAG: busy[slowest] - min(busy)}
        if all(row[4] > 0 for row in rows):
            least = min(range(len(rows)), key=lambda r: rows[r][1])  # waited least: the network's own wait
            sent = int(max(row[3] for row in rows))
            flight = rows[least][2]
            report.update({COMM_BYTES: sent, COMM_WAIT: rows[least][1]})
            if not math.isnan(flight):  # a time in flight that is not known gives no rate
                report[COMM_RATE] = sent * 8 / flight / 1e6 if flight > 0 else 0.0
        return report

    @staticmethod
    def line(report, rows, epoch, epochs):
        """The line rank 0 prints for one epoch's report (``epoch`` counted from 0)."""
        busy = [train - wait for train, wait, *_ in rows]
        steps = max(int(row[5]) for row in rows)
        train = report[TRAIN_TIME]
        if COMM_BYTES in report:
            sent = report[COMM_BYTES]
            comm = ('each rank sent {} ({} per step), waited {:.3f} s of {:.3f} s training ({:.1f} %) on communication '
                    'compute did not hide, {}').format(
                _size(sent), _size(sent / steps if steps else 0), report[COMM_WAIT], train,
                100 * report[COMM_WAIT] / train if train > 0 else 0.0,
                'link {:.1f} Mbit/s'.format(report[COMM_RATE]) if COMM_RATE in report else
                'link rate not known (sent while computing)')
        else:
            comm = ('communication not counted (no AllReduceGradients, nor a callback with traffic()), {:.3f} s '
                    'training').format(train)
        fastest = min(range(len(rows)), key=lambda r: busy[r])
        return 'communication, epoch {}/{}: {}; slowest rank {}, {:.3f} s of compute behind rank {}'.format(
            epoch + 1, epochs, comm, report[SLOWEST_RANK], report[SLOWEST_LAG], fastest)
