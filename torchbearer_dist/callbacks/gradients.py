"""Gradient averaging in a Trial: :class:`AllReduceGradients`, a thin callback over the bucket engine.

The engine, :mod:`torchbearer_dist.sync.buckets`, needs no torchbearer. The callback holds two objects
of its own beside it: the trainable set its buckets follow, with this rank's word on a change
(``_trainable_set.py``), and the checks of each step, the divergence sentinel among them
(``_step_checks.py``). Rebuilding the buckets when the set changes is the callback's.
"""
import warnings
import weakref

from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks._loss_reduction import check_loss_reduction, loss_is_summed
from torchbearer_dist.callbacks._step_checks import SKIPPED_STEPS, StepChecks
from torchbearer_dist.callbacks._stop_agreement import StopAgreement
from torchbearer_dist.callbacks._trainable_set import SignalBuckets, TrainableSet
from torchbearer_dist.sync import collectives, models
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import BUCKET_CAP_MB, FIRST_BUCKET_MB, check_options, check_supported

#: What a rebuild carries from the old buckets to the new ones: the communication counters, where kept.
_COUNTERS = ('bytes_sent', 'wait_seconds', 'comm_seconds')


class AllReduceGradients(Callback):
    """Average every gradient over all ranks, complete when backward returns.

    Gradients are fused into flat buckets (see :class:`~torchbearer_dist.sync.buckets.GradientBuckets`)
    whose average is complete before ``backward()`` returns, so every ``on_backward`` callback,
    wherever it sits in the list (GradientNormClipping, gradient logging), sees averaged gradients,
    with the standard closure, a custom closure or ``Trial.with_closure``.

    **Every model and optimizer the Trial holds.** The gradients of every parameter that any
    optimizer in the Trial's state steps are averaged, under whatever key the program keeps it (a
    GAN's discriminator and its optimizer, a learnable loss term), whichever backward pass produced
    them: each backward pass of a step (a closure that runs two) is averaged when it returns. A gradient that is None on
    this rank is zero-filled so that every rank issues the same collectives; frozen parameters are
    left alone. Sparse gradients are averaged (as dense, handed back sparse); complex parameters
    too. The averaged gradients are checked for NaN and Inf on every rank alike.

    Collectives run only inside the Trial's training steps: a backward outside them (after a run,
    or after a run that raised) stays local.

    **A trainable set that changes.** Parameters that become trainable (``requires_grad=True``, a
    param group added to any optimizer the Trial holds) or stop being trainable are followed from
    the next backward pass on, whichever callback changed them and wherever it sits in the list (in
    ``on_start_training``, at ``on_sample`` or ``on_step_training`` of a step): every forward pass of a
    step compares each held parameter's ``requires_grad`` and each optimizer's param-group sizes with
    the last ones seen, and a rank that sees a change says so in the last gradient bucket, at no extra
    collective. Every rank then agrees on the new set, averages that step's gradients of the new
    parameters before ``backward()`` returns, and rebuilds its buckets. A change made on some ranks
    only stops every rank at that step, naming the parameter.

    **Beside DistributedDataParallel.** With a DDP model, the gradients DDP averages are left to it;
    those of every other model and optimizer the Trial holds are averaged here, and the divergence
    sentinel runs as usual (:class:`AgreeOnStop`, the DDP path of :func:`distributed_callbacks`, does
    this by itself). A parameter inside the DDP model that changes trainability stops every rank: DDP
    cannot follow it.

    It also makes every rank stop at the same step when a callback on any rank sets
    ``state[torchbearer.STOP_TRAINING]`` (TerminateOnNaN, EarlyStopping): the request travels with
    the next step's gradients, at no extra cost (see :class:`AgreeOnStop`).

    At the end of each training pass it copies rank 0's buffers (BatchNorm running statistics), which
    each rank updates from its own batches, to every rank (for every module in the Trial's state):
    validation, checkpoints and :class:`CheckReplicas` then see one model.

    **Divergence sentinel.** After the first step of each run and at the end of every training pass,
    the ranks compare a fingerprint of every synchronised parameter and buffer (two integers per
    tensor, one collective of eight integers when they agree). Should anything escape the
    synchronisation (a module stepped by an optimizer the state does not hold, a callback that
    edits weights on one rank), every rank raises, naming the tensor and the step, within one epoch
    instead of training a silently different model.

    **Summed losses.** A loss that is a sum over the batch (a torch loss module with
    ``reduction='sum'``, recognised; or ``loss_reduction='sum'``) has its gradients summed over
    ranks instead of averaged: one process at N x B sums over all N x B samples.

    Example: ::

        >>> from torchbearer import Trial
        >>> from torchbearer_dist import AllReduceGradients
        >>> trial = Trial(torch.nn.Linear(2, 1), callbacks=[AllReduceGradients()])

    Args:
        bucket_cap_mb (float): capacity of a gradient bucket in MiB
        first_bucket_mb (float): capacity of the first bucket sent, small so sending starts early
        compression (str): ``None``, ``'fp16'`` or ``'bf16'``: the dtype gradients travel in; or
            ``'powersgd'``: gradient matrices travel as rank-``powersgd_rank`` factors with error
            feedback (see :class:`~torchbearer_dist.PowerSGD`), for links slower than the compute;
            the average is then approximate, the replicas still identical; it runs at the end of
            backward (``overlap`` does not apply) and needs parameters of one floating dtype
        powersgd_rank (int): with ``compression='powersgd'``, the rank of the approximation
        powersgd_start_iter (int): with ``compression='powersgd'``, how many first steps are averaged
            uncompressed (by default 2: compression starts at the third step)
        sync_every (int): all-reduce only on every k-th backward, for gradient accumulation; the
            backward passes in between stay local (like DDP's ``no_sync``). The optimizer must then
            step only after the k-th backward and keep gradients in between, as an accumulating
            optimizer wrapper or closure does; a plain Trial steps on every batch, and its replicas
            would drift apart on the local gradients
        on_nonfinite (str): ``'skip'`` (every rank skips the optimizer step and counts it in
            :data:`SKIPPED_STEPS`) or ``'raise'`` (every rank stops with an error)
        overlap (bool or str): ``True`` starts each bucket's all-reduce from autograd hooks during
            backward; ``False`` copies every gradient in with one fused copy per bucket at the end of
            backward; ``'auto'`` overlaps only when the gradients span more than one bucket (a single
            bucket cannot overlap anything, and the hooks cost Python time per parameter)
        check_divergence (bool): compare the replicas after the first step and at the end of every
            training pass (the divergence sentinel); ``False`` turns it off
        loss_reduction (str): ``'auto'`` (a torch loss module with ``reduction='sum'`` is summed, any
            other loss averaged), ``'mean'`` or ``'sum'``: how the loss combines its samples, and so
            how gradients combine over ranks

    Raises:
        ValueError: a bad option; at the start of a run, a parameter that cannot be averaged (named)
        RuntimeError: the divergence sentinel found a tensor that differs across ranks (named, with the step)

    State Requirements:
        - :attr:`torchbearer.state.MODEL`: the model whose gradients are averaged
        - :attr:`torchbearer.state.OPTIMIZER`: its parameters outside the model are averaged too
        - any other key holding an ``nn.Module`` or an optimizer: their parameters are averaged and
          compared too
        - :attr:`torchbearer.state.CRITERION`: read for its ``reduction``

    .. warning:: A synchronization point on every backward: every rank must run the same number of
        steps (see :class:`EvenBatches`).
    """

    def __init__(self, bucket_cap_mb=BUCKET_CAP_MB, first_bucket_mb=FIRST_BUCKET_MB, compression=None, sync_every=1,
                 on_nonfinite='skip', overlap='auto', powersgd_rank=4, powersgd_start_iter=2, check_divergence=True,
                 loss_reduction='auto'):
        super().__init__()
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError('sync_every should be an integer >= 1, but given {!r}'.format(sync_every))
        if on_nonfinite not in ('skip', 'raise'):
            raise ValueError("on_nonfinite should be 'skip' or 'raise', but given {!r}".format(on_nonfinite))
        check_options(bucket_cap_mb, compression, overlap)
        for name, value, low in (('powersgd_rank', powersgd_rank, 1), ('powersgd_start_iter', powersgd_start_iter, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError('{} should be an integer >= {}, but given {!r}'.format(name, low, value))
        if not isinstance(check_divergence, bool):
            raise ValueError('check_divergence should be True or False, but given {!r}'.format(check_divergence))
        check_loss_reduction(loss_reduction)
        self.options = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compression=compression,
                            overlap=overlap, sync_every=sync_every)
        if compression == 'powersgd':
            self.options['powersgd'] = dict(matrix_approximation_rank=powersgd_rank, start_iter=powersgd_start_iter)
        self.sync_every = sync_every
        self.checks = StepChecks(check_divergence, on_nonfinite)  # the sentinel and the non-finite average's rule
        self.loss_reduction = loss_reduction
        self.buckets = None
        self._ddp = False
        self._summed = False
        self._steps = 0  # training steps of this run, for the sentinel's first check
        self._owner = None  # weak reference to the state of the run whose training steps are hooked
        self._warned_ddp = False
        self._quiet_ddp = False  # made by AgreeOnStop for a DDP model: its gradients are left to DDP without a word
        self.trainable_set = TrainableSet()  # the set the buckets follow, and this rank's word on a change
        self._in_step = False
        self._pre_hooks = []  # forward pre-hooks on every held module: a change made before the forward counts
        # The stop agreement is held, not inherited: this callback carries its stop requests (a StopCarrier).
        self._agreement = StopAgreement(self, carrier=self)

    @classmethod
    def _beside_ddp(cls, agreement):
        """The AllReduceGradients that ``agreement`` (AgreeOnStop's, on a DDP model) runs for everything else."""
        self = cls()
        self._agreement = agreement
        agreement.carrier = weakref.proxy(self)
        self._quiet_ddp = True
        return self

    def on_start(self, state):
        self._steps = 0
        if collectives.world_size() == 1:
            return
        self._ddp = bool(_held.ddp_parameters(state))
        if self._ddp and not self._quiet_ddp and not self._warned_ddp:
            self._warned_ddp = True
            warnings.warn('the model is already DistributedDataParallel, which averages gradients itself: '
                          'AllReduceGradients leaves them alone and averages only those of the other models the '
                          'Trial holds (AgreeOnStop does the same without this warning)', stacklevel=2)
        self._summed = loss_is_summed(state, self.loss_reduction)
        check_supported(self._wanted(state))  # before any collective of the run

    def _wanted(self, state):
        """``(name, parameter)`` of what the buckets average: the trainable set, less what a DDP model averages."""
        ddp = _held.ddp_parameters(state)
        return [(name, p) for name, p in _held.trainable(state) if id(p) not in ddp]

    def _build(self, params):
        return SignalBuckets(params, weakref.ref(self), **dict(self.options, average=not self._summed))

    def _release(self):
        """Remove every hook of this callback: the buckets' and the forward pre-hooks."""
        if self.buckets is not None:
            self.buckets.detach()
        for handle in self._pre_hooks:
            handle.remove()
        self._pre_hooks = []
        self._in_step = False

    def on_start_training(self, state):
        self._agreement.open_run(state)
        self._release()  # hooks of an earlier Trial or run, whatever way it ended
        if collectives.world_size() == 1:
            self.buckets = None
            return
        params = [p for _, p in self._wanted(state)]
        average = not self._summed
        if self.buckets is None or not self.buckets.same_params(params) or self.buckets.average != average:
            self.buckets = self._build(params) if params else None
        self.trainable_set.follow_from(state)
        state[SKIPPED_STEPS] = self.checks.skipped
        modules = [module for _, module in _held.held_modules(state)]
        # Every forward pass of a training step first looks whether a callback changed the trainable set.
        self._pre_hooks = [module.register_forward_pre_hook(self._on_forward) for module in modules]
        if self.buckets is not None:
            self.buckets.attach([m for m in modules if not isinstance(m, DistributedDataParallel)])
        if self._owner is None or self._owner() is not state:
            # torchbearer skips on_end when run() raises: the hooks also go when this run's state does.
            self._owner = weakref.ref(state)
            weakref.finalize(state, self._expire, weakref.ref(self))

    @staticmethod
    def _expire(ref):
        self = ref()
        if self is not None and self._owner is not None and self._owner() is None:
            self._release()

    def on_end(self, state):
        self._agreement.close_run(state)
        # Only the end of the run that attached them: an evaluate() nested in a run leaves them alone.
        if self._owner is not None and self._owner() is state:
            self._release()

    def on_sample(self, state):
        if collectives.world_size() == 1:
            return
        self._in_step = True
        if self.buckets is not None:
            self.buckets.arm()
        self._look(state)

    def _on_forward(self, module, inputs):
        """A forward pre-hook on every held module: within a training step, look whether the set changed."""
        if self._in_step:
            state = self._owner() if self._owner is not None else None
            if state is not None:
                self._look(state)

    def _look(self, state):
        """Look whether this rank's trainable set changed, and put its word in the last bucket's signal slot."""
        self.trainable_set.sense(state)
        self.trainable_set.signal(self.buckets)

    # --- following a trainable set that changes (see _trainable_set.py) ----------------------------------------

    def _reduced(self, buckets):
        """Called by the buckets after each synchronising backward: if any rank's trainable set changed, follow it
        on every rank."""
        if self.trainable_set.changed_on_any_rank(buckets):
            self._follow(self._owner(), during_backward=True)
        self.trainable_set.signal(self.buckets)

    def _follow(self, state, during_backward):
        """Every rank learnt that some rank's trainable set changed: agree on it, and average it from now on.

        Called on every rank at the same point (the decision came with the gradients or the stop
        agreement). If the ranks' sets differ, or a change is inside a DDP model (whose reducer
        cannot follow it), every rank raises the same error. ``during_backward``: this step's
        gradients of newly trainable parameters are averaged now, before backward returns.
        """
        wanted = self.trainable_set.agree(state)
        old = self.buckets
        held = set() if old is None else {id(p) for p in old.params}
        added = [p for _, p in wanted if id(p) not in held]
        nonfinite = False
        if during_backward and added and old is not None and old.synced:
            # This step's gradients of the newly trainable parameters: averaged now, as one process at N x B has them.
            extra = GradientBuckets(added, bucket_cap_mb=self.options['bucket_cap_mb'],
                                    first_bucket_mb=self.options['first_bucket_mb'],
                                    compression=None if self.options['compression'] == 'powersgd' else
                                    self.options['compression'], overlap=False, average=not self._summed)
            extra.reduce()
            nonfinite = extra.nonfinite
        new = self._build([p for _, p in wanted]) if wanted else None
        if old is not None:
            old.detach()
        if new is not None:
            modules = [m for _, m in _held.held_modules(state) if not isinstance(m, DistributedDataParallel)]
            new.attach(modules)
            if self._in_step:
                new.arm()
            if old is not None:  # the step goes on with the new buckets: what it learnt so far goes with it
                new.backwards, new.began, new.synced, new.stop = old.backwards, old.began, old.synced, old.stop
                new.nonfinite = old.nonfinite
                for counter in _COUNTERS:
                    if hasattr(old, counter):
                        setattr(new, counter, getattr(old, counter))
            if nonfinite:
                new.nonfinite = True
                for p in new.params:
                    p.grad = None
        self.buckets = new
        self.trainable_set.follow_from(state)

    def on_end_training(self, state):
        self._in_step = False
        if self.buckets is not None:
            self.buckets.disarm()
        if collectives.world_size() > 1:
            models.broadcast_buffers_of([module for _, module in _held.held_modules(state)])
            self.checks.divergence(state, True, self._steps)

    def on_backward(self, state):
        if self.buckets is not None:
            self.buckets.end_backward()
            self.checks.step(state, self.buckets)

    # --- the stop carrier (callbacks/stop.py): a stop request rides in the last bucket's stop flag ----------

    def _after_step(self, state):
        """Called by the stop agreement's companion after every other callback of the step."""
        if self.buckets is not None:
            self.buckets.end_backward()
            self.checks.step(state, self.buckets)
            self.buckets.disarm()
        self._in_step = False
        self._steps += 1
        if self._steps == 1:
            self.checks.divergence(state, False, self._steps)

    @property
    def skipped(self):
        """Training steps skipped because the averaged gradients were not finite, over this callback's life."""
        return self.checks.skipped

    @property
    def check_divergence(self):
        """Whether the divergence sentinel runs (the ``check_divergence`` option)."""
        return self.checks.check_divergence

    @property
    def on_nonfinite(self):
        """What a non-finite average does: ``'skip'`` or ``'raise'`` (the ``on_nonfinite`` option)."""
        return self.checks.on_nonfinite

    def _carried_stop(self):
        """None without buckets (the agreement all-reduces its own word), else whether this step's gradients
        brought a stop request."""
        buckets = self.buckets
        return None if buckets is None else buckets.synced and buckets.stop

    def _request_stop(self):
        self.buckets.request_stop()

    def _change_word(self, state):
        """This rank's word on its trainable set, for a stop agreement that travels without buckets."""
        return self.trainable_set.word(state) if self.buckets is None else False
