"""Gradient averaging in a Trial: :class:`AllReduceGradients`, a thin callback over the bucket engine.

The engine, :mod:`torchbearer_dist.sync.buckets`, needs no torchbearer.
"""
import warnings
import weakref

import torch
import torchbearer
from torch.nn.parallel import DistributedDataParallel
from torchbearer import Callback

from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks.stop import AgreeOnStop
from torchbearer_dist.sync import collectives, models
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import check_options, check_supported

#: What a rebuild carries from the old buckets to the new ones: the communication counters, where kept.
_COUNTERS = ('bytes_sent', 'wait_seconds', 'comm_seconds')

#: State key: how many steps were skipped because the averaged gradients were not finite.
SKIPPED_STEPS = torchbearer.state_key('skipped_steps')


def loss_is_summed(state, loss_reduction):
    """Whether the Trial's loss is a sum over the batch: ``loss_reduction``, or for ``'auto'`` the criterion's own.

    ``'auto'`` recognises a torch loss module with ``reduction='sum'``; a loss function it cannot
    inspect counts as a mean, as one process at N x B averages over its batch.
    """
    if loss_reduction != 'auto':
        return loss_reduction == 'sum'
    criterion = state.get(torchbearer.CRITERION)
    return isinstance(criterion, torch.nn.Module) and getattr(criterion, 'reduction', None) == 'sum'


def _ddp_parameters(state):
    """ids of the parameters that a DistributedDataParallel model in the state averages itself."""
    return {id(p) for _, module in _held.held_modules(state) if isinstance(module, DistributedDataParallel)
            for p in module.parameters()}


def _ranks(ranks):
    return '{} {}'.format('rank' if len(ranks) == 1 else 'ranks', ', '.join(str(r) for r in ranks))


class _Buckets(GradientBuckets):
    """The bucket engine, telling its owner when the average of a synchronising backward is complete.

    The owner's trainable-set signal rides in the last bucket's signal slot; after :meth:`reduce` the
    slot holds its sum over ranks, identical everywhere, so every rank decides alike.
    """

    def __init__(self, params, owner, **options):
        super().__init__(params, **options)
        self._owner = owner  # weak reference to the AllReduceGradients

    def reduce(self):
        owner = self._owner()
        if owner is not None:
            owner._signal(self)  # non-overlapped buckets leave now: a change sensed since the forward pass counts
        super().reduce()
        if owner is not None:
            owner._reduced(self)


def check_loss_reduction(loss_reduction):
    """Raise ValueError, naming the value, unless ``loss_reduction`` is 'auto', 'mean' or 'sum'."""
    if loss_reduction not in ('auto', 'mean', 'sum'):
        raise ValueError("loss_reduction should be 'auto', 'mean' or 'sum', but given {!r}".format(loss_reduction))


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

    def __init__(self, bucket_cap_mb=25.0, first_bucket_mb=1.0, compression=None, sync_every=1,
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
        self.on_nonfinite = on_nonfinite
        self.check_divergence = check_divergence
        self.loss_reduction = loss_reduction
        self.skipped = 0
        self.buckets = None
        self._ddp = False
        self._summed = False
        self._steps = 0  # training steps of this run, for the sentinel's first check
        self._owner = None  # weak reference to the state of the run whose training steps are hooked
        self._warned_ddp = False
        self._quiet_ddp = False  # made by AgreeOnStop for a DDP model: its gradients are left to DDP without a word
        self._trainable = set()  # ids of the trainable set the buckets follow (DDP's parameters included)
        self._watch = None  # a cheap sign that the trainable set may have moved (see _held.TrainableWatch)
        self._change = False  # this rank's trainable set differs from self._trainable: awaiting every rank's word
        self._in_step = False
        self._pre_hooks = []  # forward pre-hooks on every held module: a change made before the forward counts
        # The stop agreement is held, not inherited: its companion calls _after_step after every other callback.
        self._agreement = AgreeOnStop()
        self._agreement.gradients = weakref.proxy(self)
        self._agreement._owned = True

    @classmethod
    def _beside_ddp(cls, agreement):
        """The AllReduceGradients that ``agreement`` (an AgreeOnStop on a DDP model) runs for everything else."""
        self = cls()
        self._agreement = agreement
        agreement.gradients = weakref.proxy(self)
        self._quiet_ddp = True
        return self

    def on_start(self, state):
        self._steps = 0
        if collectives.world_size() == 1:
            return
        self._ddp = bool(_ddp_parameters(state))
        if self._ddp and not self._quiet_ddp and not self._warned_ddp:
            self._warned_ddp = True
            warnings.warn('the model is already DistributedDataParallel, which averages gradients itself: '
                          'AllReduceGradients leaves them alone and averages only those of the other models the '
                          'Trial holds (AgreeOnStop does the same without this warning)', stacklevel=2)
        self._summed = loss_is_summed(state, self.loss_reduction)
        check_supported(self._wanted(state))  # before any collective of the run

    def _wanted(self, state):
        """``(name, parameter)`` of what the buckets average: the trainable set, less what a DDP model averages."""
        ddp = _ddp_parameters(state)
        return [(name, p) for name, p in _held.trainable(state) if id(p) not in ddp]

    def _build(self, params):
        return _Buckets(params, weakref.ref(self), **dict(self.options, average=not self._summed))

    def _release(self):
        """Remove every hook of this callback: the buckets' and the forward pre-hooks."""
        if self.buckets is not None:
            self.buckets.detach()
        for handle in self._pre_hooks:
            handle.remove()
        self._pre_hooks = []
        self._in_step = False

    def on_start_training(self, state):
        self._agreement._open_run(state)
        self._release()  # hooks of an earlier Trial or run, whatever way it ended
        if collectives.world_size() == 1:
            self.buckets = None
            return
        params = [p for _, p in self._wanted(state)]
        average = not self._summed
        if self.buckets is None or not self.buckets.same_params(params) or self.buckets.average != average:
            self.buckets = self._build(params) if params else None
        self._follow_from(state)
        state[SKIPPED_STEPS] = self.skipped
        modules = [module for _, module in _held.held_modules(state)]
        # Every forward pass of a training step first looks whether a callback changed the trainable set.
        self._pre_hooks = [module.register_forward_pre_hook(self._on_forward) for module in modules]
        if self.buckets is not None:
            self.buckets.attach([m for m in modules if not isinstance(m, DistributedDataParallel)])
        if self._owner is None or self._owner() is not state:
            # torchbearer skips on_end when run() raises: the hooks also go when this run's state does.
            self._owner = weakref.ref(state)
            weakref.finalize(state, self._expire, weakref.ref(self))

    def _follow_from(self, state):
        """Take the state's trainable set as the one the buckets follow from now on."""
        self._trainable = {id(p) for _, p in _held.trainable(state)}
        self._watch = _held.TrainableWatch(state)
        self._change = False

    @staticmethod
    def _expire(ref):
        self = ref()
        if self is not None and self._owner is not None and self._owner() is None:
            self._release()

    def on_end(self, state):
        self._agreement._close_run(state)
        # Only the end of the run that attached them: an evaluate() nested in a run leaves them alone.
        if self._owner is not None and self._owner() is state:
            self._release()

    def on_sample(self, state):
        if collectives.world_size() == 1:
            return
        self._in_step = True
        if self.buckets is not None:
            self.buckets.arm()
        self._sense(state)
        self._signal(self.buckets)

    def _on_forward(self, module, inputs):
        if self._in_step:
            state = self._owner() if self._owner is not None else None
            if state is not None:
                self._sense(state)
                self._signal(self.buckets)

    def _sense(self, state):
        """Whether this rank's trainable set now differs from the one the buckets follow (cheap when nothing moved)."""
        if not self._change and self._watch is not None and self._watch.changed():
            if {id(p) for _, p in _held.trainable(state)} != self._trainable:
                self._change = True
            else:  # something moved without changing what is averaged (a frozen parameter no optimizer holds)
                self._watch = _held.TrainableWatch(state)
        return self._change

    def _signal(self, buckets):
        """Write this rank's word into the last bucket's signal slot, unless that bucket is already on its way."""
        if buckets is not None and buckets.buckets and not buckets.buckets[-1].sent:
            buckets.buckets[-1].signal.fill_(1.0 if self._change else 0.0)

    def _reduced(self, buckets):
        """After each synchronising backward: if any rank's trainable set changed, follow it on every rank."""
        if buckets.buckets:
            changed = buckets.buckets[-1].signal.item() > 0  # the sum over ranks, the same everywhere
        else:  # PowerSGD holds no bucket to ride in: a word of its own
            changed = collectives.any_rank(self._change)
        if changed:
            self._follow(self._owner(), during_backward=True)
        self._signal(self.buckets)

    def _follow(self, state, during_backward):
        """Every rank learnt that some rank's trainable set changed: agree on it, and average it from now on.

        Called on every rank at the same point (the decision came with the gradients or the stop
        agreement). If the ranks' sets differ, or a change is inside a DDP model (whose reducer
        cannot follow it), every rank raises the same error. ``during_backward``: this step's
        gradients of newly trainable parameters are averaged now, before backward returns.
        """
        named = _held.parameters(state)
        trainable = _held.trainable(state)
        now = {id(p) for _, p in trainable}
        self._agree(state, named, [1 if id(p) in now else 0 for _, p in named])
        changed = [(name, p) for name, p in named if (id(p) in now) != (id(p) in self._trainable)]
        ddp = _ddp_parameters(state)
        inside = [(name, p) for name, p in changed if id(p) in ddp]
        if inside:
            name, p = inside[0]
            raise RuntimeError("'{}' became {} inside the DistributedDataParallel model at epoch {}, batch {}: DDP "
                               "averages only the parameters that were trainable when it was wrapped, so the replicas "
                               "would drift; set requires_grad before wrap_ddp (wrap the model again after a change), "
                               "or keep that part outside DDP".format(
                                   name, 'trainable' if id(p) in now else 'frozen', state.get(torchbearer.EPOCH),
                                   state.get(torchbearer.BATCH)))
        wanted = [(name, p) for name, p in trainable if id(p) not in ddp]
        check_supported(wanted)  # the same set on every rank: every rank raises alike
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
        self._follow_from(state)

    def _agree(self, state, named, codes):
        """Raise on every rank, naming the first parameter whose trainability differs across ranks, if any does."""
        device = collectives.comm_device(named[0][1].device if named else torch.device('cpu'))
        digest = collectives._hash(''.join(str(c) for c in codes))
        (count_max, hash_max), (count_min, hash_min) = collectives._max_and_min([len(codes), digest], device)
        if count_max != count_min:
            raise RuntimeError('the ranks hold different numbers of parameters ({} to {}) at epoch {}, batch {}; every '
                               'rank must hold the same models and optimizers'.format(
                                   count_min, count_max, state.get(torchbearer.EPOCH), state.get(torchbearer.BATCH)))
        if hash_max == hash_min:
            return
        high, low = collectives._max_and_min(codes, device)
        first = next(i for i in range(len(codes)) if high[i] != low[i])
        size, rank = collectives.world_size(), collectives.rank()
        votes = torch.zeros(size, dtype=torch.int64, device=device)
        votes[rank] = codes[first]
        torch.distributed.all_reduce(votes)
        votes = votes.tolist()
        name, p = named[first]
        raise RuntimeError("the trainable parameters differ across ranks at epoch {}, batch {}: '{}' is trainable "
                           "on {} and not on {} (it was {} on every rank before); change requires_grad and the "
                           "optimizers' param groups alike on every rank, from a callback that every rank runs".format(
                               state.get(torchbearer.EPOCH), state.get(torchbearer.BATCH), name,
                               _ranks([r for r in range(size) if votes[r]]),
                               _ranks([r for r in range(size) if not votes[r]]),
                               'trainable' if id(p) in self._trainable else 'not trainable'))

    def on_end_training(self, state):
        self._in_step = False
        if self.buckets is not None:
            self.buckets.disarm()
        if collectives.world_size() > 1:
            models.broadcast_buffers_of([module for _, module in _held.held_modules(state)])
            self._check_divergence(state, buffers=True)

    def on_backward(self, state):
        if self.buckets is not None:
            self.buckets.end_backward()
            self._check_step(state)

    def _after_step(self, state):
        """Called by the stop agreement's companion after every other callback of the step."""
        if self.buckets is not None:
            self.buckets.end_backward()
            self._check_step(state)
            self.buckets.disarm()
        self._in_step = False
        self._steps += 1
        if self._steps == 1:
            self._check_divergence(state, buffers=False)

    def _change_word(self, state):
        """This rank's word on its trainable set, for a stop agreement that travels without buckets."""
        return self._sense(state) if self.buckets is None and self._watch is not None else False

    def _check_divergence(self, state, buffers):
        """The divergence sentinel: every rank raises, naming the tensor and the step, if the replicas differ."""
        if not self.check_divergence or collectives.world_size() == 1:
            return
        entries = _held.synchronised(state)
        if not buffers:  # within a pass each rank's buffers (BatchNorm statistics) follow its own batches
            entries = [(name, t) for name, t in entries if isinstance(t, torch.nn.Parameter)]
        differing = models.differing_tensors(entries)
        if differing:
            where = 'after the first step' if not buffers else 'at the end of the training pass'
            raise RuntimeError("replicas diverged {} (epoch {}, step {}): '{}' differs across ranks ({} of {} tensors "
                               "differ); something updated it on one rank only, such as an optimizer or module that "
                               "trial.state does not hold (store it there) or a callback that edits weights on one "
                               "rank; AllReduceGradients(check_divergence=False) turns this check off".format(
                                   where, state.get(torchbearer.EPOCH), self._steps, differing[0], len(differing),
                                   len(entries)))

    def _check_step(self, state):
        buckets = self.buckets
        if buckets.missed():
            raise RuntimeError('gradients were computed without passing through the output of state[MODEL], so they '
                               'were not averaged; pass overlap=True to AllReduceGradients')
        if not buckets.synced or not buckets.nonfinite:
            return
        if self.on_nonfinite == 'raise':
            raise RuntimeError('the averaged gradients hold NaN or Inf at epoch {}, batch {} (on every rank); '
                               'lower the learning rate, or pass on_nonfinite="skip" to skip such steps'.format(
                                   state[torchbearer.EPOCH], state[torchbearer.BATCH]))
        buckets.nonfinite = False  # counted once, whether on_backward runs or not
        self.skipped += 1
        state[SKIPPED_STEPS] = self.skipped
        if self.skipped == 1 and collectives.rank() == 0:
            warnings.warn('averaged gradients hold NaN or Inf: every rank skips this step; skipped steps are '
                          'counted in state[torchbearer_dist.SKIPPED_STEPS]', stacklevel=2)
