"""Following a trainable set that changes during a run: the part of :class:`~torchbearer_dist.AllReduceGradients` that
notices a change, agrees on it with every rank and rebuilds the buckets.

Every forward pass of a training step compares each held parameter's ``requires_grad`` and each optimizer's
param-group sizes with the last ones seen (:class:`~torchbearer_dist.callbacks._held.TrainableWatch`); a rank
that sees a change writes a word into the last bucket's signal slot, which the all-reduce sums with the
gradients at no extra collective (or, without buckets, the stop agreement's own all-reduce carries it). Every
rank then checks that the sets agree, averages the step's gradients of newly trainable parameters before
``backward()`` returns, and rebuilds its buckets.
"""
import torch
import torchbearer
from torch.nn.parallel import DistributedDataParallel

from torchbearer_dist.callbacks import _held
from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import check_supported

#: What a rebuild carries from the old buckets to the new ones: the communication counters, where kept.
_COUNTERS = ('bytes_sent', 'wait_seconds', 'comm_seconds')


def _ranks(ranks):
    return '{} {}'.format('rank' if len(ranks) == 1 else 'ranks', ', '.join(str(r) for r in ranks))


class SignalBuckets(GradientBuckets):
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


class FollowTrainableSet:
    """What AllReduceGradients does when a callback changes the trainable set (a mixin, with its attributes).

    It reads ``buckets``, ``options``, ``_summed``, ``_in_step``, ``_owner`` (a weak reference to the
    run's state) and ``_build(params)`` of the callback, and keeps ``_trainable`` (the ids of the set the
    buckets follow), ``_watch`` and ``_change`` (this rank saw a change, awaiting every rank's word).
    """


    def _follow_from(self, state):
        """Take the state's trainable set as the one the buckets follow from now on."""
        self._trainable = {id(p) for _, p in _held.trainable(state)}
        self._watch = _held.TrainableWatch(state)
        self._change = False

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
        ddp = _held.ddp_parameters(state)
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

    def _change_word(self, state):
        """This rank's word on its trainable set, for a stop agreement that travels without buckets."""
        return self._sense(state) if self.buckets is None and self._watch is not None else False
