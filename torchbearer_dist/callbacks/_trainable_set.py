"""Following a trainable set that changes during a run: :class:`TrainableSet`, an object of
:class:`~torchbearer_dist.AllReduceGradients` that notices a change and agrees on it with every rank.

Every forward pass of a training step compares each held parameter's ``requires_grad`` and each optimizer's
param-group sizes with the last ones seen (:class:`~torchbearer_dist.callbacks._held.TrainableWatch`); a rank
that sees a change writes a word into the last bucket's signal slot, which the all-reduce sums with the
gradients at no extra collective (or, without buckets, the stop agreement's own all-reduce carries it). Every
rank then checks that the sets agree, and the callback averages the step's gradients of newly trainable
parameters before ``backward()`` returns and rebuilds its buckets.
"""
import torch
import torchbearer

from torchbearer_dist.callbacks import _held
from torchbearer_dist.sync import collectives
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.flat_buckets import check_supported


def _ranks(ranks):
    return '{} {}'.format('rank' if len(ranks) == 1 else 'ranks', ', '.join(str(r) for r in ranks))


class SignalBuckets(GradientBuckets):
    """The bucket engine, telling its owner when the average of a synchronising backward is complete.

    The owner's trainable-set signal rides in the last bucket's signal slot; after :meth:`reduce` the
    slot holds its sum over ranks, identical everywhere, so every rank decides alike.

    Args:
        params (list): the parameters whose gradients are averaged
        owner (weakref.ref): the :class:`~torchbearer_dist.AllReduceGradients` whose ``trainable_set`` writes
            the signal and whose ``_reduced(buckets)`` is called after each reduce
        **options: the options of :class:`~torchbearer_dist.sync.buckets.GradientBuckets`
    """

    def __init__(self, params, owner, **options):
        super().__init__(params, **options)
        self._owner = owner  # weak reference to the AllReduceGradients

    def reduce(self):
        owner = self._owner()
        if owner is not None:
            owner.trainable_set.signal(self)  # non-overlapped buckets leave now: a change since the forward counts
        super().reduce()
        if owner is not None:
            owner._reduced(self)


class TrainableSet:
    """The trainable set that the buckets of :class:`~torchbearer_dist.AllReduceGradients` follow, and this
    rank's word on whether it changed: an object of the callback, held as ``trainable_set``.

    Everything else it is handed: the run's state, the buckets its word rides in. Rebuilding the buckets
    when the set changes is the callback's (``AllReduceGradients._follow``).

    Attributes:
        ids (set): the ids of the parameters of the set followed, DDP's included
        watch (TrainableWatch): a cheap sign that the set may have moved (see
            :class:`~torchbearer_dist.callbacks._held.TrainableWatch`); None before the first run
        change (bool): this rank's set differs from ``ids``: awaiting every rank's word
    """

    def __init__(self):
        self.ids = set()
        self.watch = None
        self.change = False

    def follow_from(self, state):
        """Take the state's trainable set as the one the buckets follow from now on."""
        self.ids = {id(p) for _, p in _held.trainable(state)}
        self.watch = _held.TrainableWatch(state)
        self.change = False

    def sense(self, state):
        """Whether this rank's trainable set now differs from the one the buckets follow (cheap when nothing moved)."""
        if not self.change and self.watch is not None and self.watch.changed():
            if {id(p) for _, p in _held.trainable(state)} != self.ids:
                self.change = True
            else:  # something moved without changing what is averaged (a frozen parameter no optimizer holds)
                self.watch = _held.TrainableWatch(state)
        return self.change

    def signal(self, buckets):
        """Write this rank's word into the last bucket's signal slot of ``buckets`` (None: no buckets), unless
        that bucket is already on its way."""
        if buckets is not None and buckets.buckets and not buckets.buckets[-1].sent:
            buckets.buckets[-1].signal.fill_(1.0 if self.change else 0.0)

    def changed_on_any_rank(self, buckets):
        """After ``buckets`` reduced a synchronising backward: whether any rank's trainable set changed.

        .. warning:: A synchronization point where ``buckets`` hold no bucket (PowerSGD): the word then
            travels in an all-reduce of its own.
        """
        if buckets.buckets:
            return buckets.buckets[-1].signal.item() > 0  # the sum over ranks, the same everywhere
        return collectives.any_rank(self.change)  # PowerSGD holds no bucket to ride in: a word of its own

    def word(self, state):
        """This rank's word on its trainable set, for a stop agreement that travels without buckets."""
        return self.sense(state) if self.watch is not None else False

    def agree(self, state):
        """Every rank learnt that some rank's trainable set changed: agree on it, and return what to average.

        Called on every rank at the same point (the decision came with the gradients or the stop agreement).

        Args:
            state (dict): the run's state

        Returns:
            list: ``(name, parameter)`` of the new trainable set, less what a DDP model averages

        Raises:
            RuntimeError: on every rank alike, if the ranks' sets differ, or a change is inside a DDP model
                (whose reducer cannot follow it)
            ValueError: on every rank alike, a parameter of the new set that cannot be averaged

        .. warning:: A synchronization point: every rank must call it at the same point.
        """
        named = _held.parameters(state)
        trainable = _held.trainable(state)
        now = {id(p) for _, p in trainable}
        self._agree(state, named, [1 if id(p) in now else 0 for _, p in named])
        changed = [(name, p) for name, p in named if (id(p) in now) != (id(p) in self.ids)]
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
        return wanted

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
                               'trainable' if id(p) in self.ids else 'not trainable'))
