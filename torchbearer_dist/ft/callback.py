"""Training through lost machines: a Trial's steps driven through torchft's Manager (the fault-tolerant mode)."""
import socket
import weakref

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist.callbacks._batches import batch_size
from torchbearer_dist.callbacks._held import trainable
from torchbearer_dist.callbacks._loss_reduction import check_loss_reduction, loss_is_summed
from torchbearer_dist.checkpoint import _midepoch
from torchbearer_dist.checkpoint.callback import WRITER
from torchbearer_dist.data import distributed_sampler
from torchbearer_dist.ft import _heal
from torchbearer_dist.ft.replica import Replica, lighthouse_address
from torchbearer_dist.sync import collectives, meeting
from torchbearer_dist.sync._autograd import queue_at_backward_end
from torchbearer_dist.sync.flat_buckets import BUCKET_CAP_MB, FIRST_BUCKET_MB, pack


class FaultTolerantAllReduce(Callback):
    """Average gradients over the live replicas through torchft, heal a (re)started replica from a healthy one.

    Each process is a torchft replica group of one. At every step it joins the lighthouse's quorum of live
    replicas, averages its gradients over them (in buckets sent while backward runs, as the fail-fast mode's, and
    done before ``backward()`` returns, so every ``on_backward`` callback sees the average) and steps every
    optimizer the Trial holds only if torchft commits the step: a step during which a replica was lost is
    dropped on every survivor, who go on among themselves. A replica that starts while others train heals at
    the start of ``run()`` from a healthy one (every model and optimizer the Trial holds, the callbacks'
    states, the history, the position in the epoch) and trains the healer's next batch beside it. At the first
    step every replica takes the first one's weights (torchft's ``init_sync``). With ``every_step=False`` it
    does neither at each step: :class:`~torchbearer_dist.DiLoCo`'s meetings go through it instead
    (``distributed_callbacks(fault_tolerant=..., local_steps=H)``).

    At each epoch end the figures are averaged over the replicas, each weighted by its samples (training
    figures by training samples, ``val_`` figures by validation ones); ``state[WRITER]`` is True on one live
    replica, where :class:`~torchbearer_dist.Checkpoint` writes.

    Example:

        .. code-block:: python

            # on each machine i of N; a lighthouse runs at ADDR:29510
            sampler = DistributedSampler(train_set, num_replicas=N, rank=i, seed=0)
            trial = Trial(model, optimizer, loss, metrics=['loss', 'acc'],
                          callbacks=tbd.distributed_callbacks(fault_tolerant='ADDR:29510', replica_id=str(i)))

    Args:
        lighthouse (str): the lighthouse's address, ``HOST:PORT``; None or True reads ``$TORCHFT_LIGHTHOUSE``
        replica_id (str): this replica's name, the same when it restarts (default: the host name)
        min_replicas (int): steps wait, up to ``timeout``, for at least this many live replicas
        timeout (float): seconds for a collective and a heal (a quorum: three times as long): how long a lost
            replica stalls the others at most. Keep the lighthouse's join timeout at least as long
        host (str): the address other replicas reach this one at (default: the one on the route to the lighthouse)
        loss_reduction (str): ``'auto'``, ``'mean'`` or ``'sum'``: a summed loss has its gradients summed
        every_step (bool): False: no quorum nor averaging at each step, DiLoCo's meetings through ``meet()``

    Raises:
        ValueError: a bad option
        RuntimeError: torchft is missing; the lighthouse does not answer (named); no quorum of ``min_replicas``
            within ``timeout``; this replica cannot heal (another model or version: on it only); a process group

    State Requirements:
        - :attr:`torchbearer.state.MODEL`, :attr:`torchbearer.state.OPTIMIZER` and any other held module
          or optimizer: averaged, gated and healed
        - :attr:`torchbearer.state.HISTORY`, :attr:`torchbearer.state.CALLBACK_LIST`: healed

    .. warning:: A synchronization point at every step, with the lighthouse and the live replicas.
    """

    def __init__(self, lighthouse=None, replica_id=None, min_replicas=1, timeout=60.0, host=None,
                 loss_reduction='auto', every_step=True):
        super().__init__()
        self.lighthouse = lighthouse_address(lighthouse)
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError('min_replicas should be an integer >= 1, but given {!r}'.format(min_replicas))
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError('timeout should be a positive number of seconds, but given {!r}'.format(timeout))
        if replica_id is not None and (not isinstance(replica_id, str) or not replica_id or ':' in replica_id):
            raise ValueError('replica_id should be a non-empty string without ":", but given {!r}'.format(replica_id))
        check_loss_reduction(loss_reduction)
        self.replica_id, self.min_replicas, self.timeout = replica_id, min_replicas, float(timeout)
        self.host, self.loss_reduction, self.every_step = host, loss_reduction, every_step
        self.replica, self._hooks = None, []
        self.writer = False  # whether this replica wrote checkpoints at the last step (the quorum's first)
        self.heals = 0  # heals of this replica in its runs (the first step's init_sync not counted)
        self._reset()

    def _reset(self):
        self._state = self._pending = None
        self._open = self._in_step = self._averaged = self._queued = self._meets = self._passing = False
        self._commit, self._params, self._gated, self._samples = None, [], [], {'train': 0, 'val': 0}
        self._buckets, self._slots, self._next = [], {}, 0  # the gradient buckets, each parameter's, the next to send

    # --- the run: a replica per run(), its quorum at every step ----------------------------------------

    def on_start(self, state):
        if state.get(torchbearer.GENERATOR) is not None:
            return  # evaluate() and predict() set their loader before on_start; run() does not: no quorum there
        if collectives.world_size() > 1:
            raise RuntimeError('the fault-tolerant mode runs one process per replica group, but this process is in a '
                               'process group of {}; start each replica alone (no torchrun/launch process group)'
                               .format(collectives.world_size()))
        self._release()
        self._reset()
        self._state = weakref.ref(state)  # not kept alive by this callback: a run that raises frees it
        self._summed = loss_is_summed(state, self.loss_reduction)
        replica_id = self.replica_id or socket.gethostname().replace(':', '_')
        self.replica = Replica(self.lighthouse, replica_id, self._load, self._save, self.min_replicas,
                               self.timeout, self.host)
        weakref.finalize(state, FaultTolerantAllReduce._expire, weakref.ref(self), self._state)
        if self.every_step:
            self._gate(state)
        self._start_quorum()  # a replica that starts late heals here, before its first epoch begins
        self._open = True  # this quorum serves the first step

    def _start_quorum(self, shrink_only=False):
        self.replica.start_quorum(shrink_only)
        self.writer = self._state()[WRITER] = self.replica.manager.participating_rank() == 0

    def on_start_training(self, state):
        if self.replica is None:
            return
        pending, self._pending = self._pending, None
        if pending is not None and pending['epoch'] == state[torchbearer.EPOCH] and pending['batches'] > 0:
            _midepoch.resume_epoch(state, pending, None)  # the healer's next batch is this replica's next
        self._samples, self._passing = {'train': 0, 'val': 0}, True
        params = [p for _, p in trainable(state)]
        if self.every_step and [id(p) for p in params] != [id(p) for p in self._params]:
            self._buckets = pack(params[::-1], BUCKET_CAP_MB, FIRST_BUCKET_MB)  # in reverse registration order
            self._slots = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._params = params
        for handle in self._hooks:  # the last epoch's: the trainable set may have changed since
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def on_sample(self, state):
        if self.replica is None:
            return
        self._samples['train'] += batch_size(state) or 0
        if not self.every_step:
            return
        self._commit, self._averaged, self._queued, self._in_step, self._next = None, False, False, True, 0
        for bucket in self._buckets:
            bucket.reset()
        if self._open:
            self._open = False
        else:
            self._start_quorum()

    def on_sample_validation(self, state):
        self._samples['val'] += batch_size(state) or 0

    def _on_grad(self, param):
        """A gradient is in: into its bucket; send each complete bucket whose predecessors were sent (the same
        order on every replica, whatever order gradients arrive in), as the fail-fast mode does."""
        if not self._in_step or self._averaged:
            return
        if not self._queued:
            self._queued = queue_at_backward_end(self._average)  # runs when this backward pass ends
        bucket, position = self._slots[id(param)]
        if not bucket.present[position]:
            bucket.put(position, param.grad)
            bucket.present[position] = True
            bucket.pending -= 1
            while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
                self._send(self._buckets[self._next])

    def on_backward(self, state):
        if self._in_step and not self._averaged:
            self._average()

    def on_step_training(self, state):
        self._in_step = False

    def _send(self, bucket):
        op = torch.distributed.ReduceOp.SUM if self._summed else torch.distributed.ReduceOp.AVG
        bucket.work = self.replica.manager.allreduce(bucket.flat, reduce_op=op)  # in place, on torchft's gloo group
        self._next += 1

    def _average(self):
        """Send the buckets backward left (a missing gradient counts as zeros), wait for every one: each ``.grad``
        is then its bucket's view of the average over the quorum."""
        self._averaged = True
        for bucket in self._buckets[self._next:]:
            bucket.fill()
            self._send(bucket)
        for bucket in self._buckets:
            bucket.work.wait()  # an error is torchft's to report: the step is then not committed
            bucket.unpack()

    def meet(self, engine, trained, quorum=True):
        """DiLoCo's meeting through torchft (:func:`~torchbearer_dist.sync.meeting.meet`); True if committed.

        After a quorum (``quorum``), where a replica behind heals and counts as not trained; one that ends a pass
        takes no new replica (``shrink_only``: healed there, it would start a pass with no batch left).
        """
        if quorum:
            heals, self._meets, state = self.heals, True, self._state()
            try:
                self._start_quorum(shrink_only=state[torchbearer.BATCH] + 1 >= state[torchbearer.STEPS] or
                                   not self._passing)
            finally:
                self._meets = False
            trained = trained and self.heals == heals
        return meeting.meet(self.replica.manager, engine, trained)

    def _gate(self, state):
        """Every optimizer of the Trial steps only if torchft commits the step (decided once per step): torchbearer
        has no hook between the closure and the update, so each held optimizer's ``step`` is shadowed for the run
        (an instance attribute, removed at its end), as torchft's own ``OptimizerWrapper`` does."""
        for optimizer in _heal.optimizers(state):
            original = optimizer.step

            def step(closure=None, _original=original):
                loss = closure() if closure is not None else None
                if self._commit is None:
                    if not self._averaged:
                        self._average()
                    self._commit = self.replica.manager.should_commit()
                if self._commit:
                    _original()
                return loss
            optimizer.step = step
            self._gated.append(optimizer)

    def on_end_training(self, state):
        self._passing = False  # DiLoCo's meeting at the run's end comes after
        self._reduce_metrics(state, self._samples['train'])

    def on_end_validation(self, state):
        self._reduce_metrics(state, self._samples['val'])

    def _reduce_metrics(self, state, weight):
        """The pass's figures, averaged over the last step's replicas weighted by their samples (before any
        ``on_end_epoch``); where a replica was lost since that step they stay this replica's own."""
        if self.replica is None:
            return
        metrics = state[torchbearer.METRICS]
        names = sorted(k for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor)) and
                       not isinstance(v, bool) and (not isinstance(v, torch.Tensor) or v.numel() == 1))
        payload = torch.tensor([float(metrics[n]) * weight for n in names] + [float(weight)], dtype=torch.float64)
        self.replica.manager.allreduce(payload, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        total = payload.tolist()
        if self.replica.manager.errored() is None and total[-1] > 0:
            for i, name in enumerate(names):
                metrics[name] = total[i] / total[-1]

    def _save(self):
        state = self._state()
        loader = state.get(torchbearer.GENERATOR)
        sampler = distributed_sampler(loader) if loader is not None else None
        # At a step's quorum: about to train batch state[BATCH]; at a meeting: after it; else at the run's start.
        training = self._in_step or self._meets
        position = {'epoch': state[torchbearer.EPOCH] if training else len(state[torchbearer.HISTORY]),
                    'batches': state[torchbearer.BATCH] + self._meets if training else 0,
                    'batch_size': getattr(getattr(loader, 'batch_sampler', None), 'batch_size', None),
                    'world_size': getattr(sampler, 'num_replicas', 1)}
        return _heal.capture(state, position)

    def _load(self, payload):
        if self.replica.manager.current_step() > 0:  # not the first step's init_sync: a heal
            self.heals += 1
        position = _heal.restore(self._state(), payload, 'a healthy replica')
        if not (self._in_step or self._meets):
            self._pending = position

    # --- the end of a run, however it ends ------------------------------------------------------------------

    def on_end(self, state):
        if self._state is not None and self._state() is state:
            self._release()

    @staticmethod
    def _expire(ref, state_ref):
        self = ref()  # torchbearer skips on_end when run() raises: the replica goes when that run's state does
        if self is not None and self._state is state_ref:
            self._release()

    def _release(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for optimizer in self._gated:
            optimizer.__dict__.pop('step', None)
        self._gated = []
        replica, self.replica = self.replica, None
        if replica is not None:
            replica.shutdown()
        self._state = None
