"""Training through lost machines: a Trial's steps driven through torchft's Manager (the fault-tolerant mode)."""
import os
import socket
import time
import weakref

import torch
import torchbearer
from torchbearer import Callback

from torchbearer_dist import _torchbearer
from torchbearer_dist.callbacks import _held
from torchbearer_dist.callbacks._held import buffers as held_buffers
from torchbearer_dist.callbacks._held import trainable
from torchbearer_dist.callbacks._loss_reduction import check_loss_reduction, loss_is_summed
from torchbearer_dist.callbacks._stop_agreement import StopAgreement
from torchbearer_dist.checkpoint import _midepoch
from torchbearer_dist.checkpoint.callback import WRITER
from torchbearer_dist.data import distributed_sampler
from torchbearer_dist.ft import _events, _heal, _signals, _torchft, _vote
from torchbearer_dist.ft._pause import PauseClock
from torchbearer_dist.ft.replica import Replica, lighthouse_address
from torchbearer_dist.sync import collectives, meeting, models
from torchbearer_dist.sync.buckets import GradientBuckets
from torchbearer_dist.sync.fingerprint import fingerprint
from torchbearer_dist.sync.group import SUM, DistGroup, HierarchicalGroup, QuorumGroup

#: Quorums in a row a replica takes while the vote refuses a replica of each (a refused one leaves at once).
VOTES = 4
#: Seconds between the quorums of an evaluate() or predict() that waits for the replicas of the last run.
PASS_POLL = 0.2
#: Launchers' counts of a job's restarts, in their processes' environment: torchrun's, SLURM's (a requeue).
RESTART_COUNTS = ('TORCHELASTIC_RESTART_COUNT', 'SLURM_RESTART_COUNT')


class FaultTolerantAllReduce(Callback):
    """Average gradients over the live replicas through torchft, heal a (re)started replica from a healthy one.

    Each process is a torchft replica group of one, or, inside a process group (torchrun, ``launch()``, srun on a
    node), one rank of the replica group that its process group's ranks form: they average among themselves and
    with the same rank of the other groups (:class:`~torchbearer_dist.sync.group.HierarchicalGroup`), and are lost
    and healed together. At every step it joins the lighthouse's quorum of live replicas (asked for as the step
    begins, taken at its first gradient bucket: torchft's asynchronous quorum, behind forward), averages its gradients
    over them (in buckets sent while backward runs, as the fail-fast mode's, and
    done before ``backward()`` returns, so every ``on_backward`` callback sees the average) and steps every
    optimizer the Trial holds only if torchft commits the step: a step during which a replica was lost is
    dropped on every survivor, who go on among themselves. A replica that starts while others train heals at
    the start of ``run()`` from a healthy one (every model and optimizer the Trial holds, the callbacks'
    states, the history, the position in the epoch) and trains the healer's next batch beside it, counting for
    nothing in that first step (it sends zeros and takes the others' average, as torchft decides). At the first
    step every replica takes the first one's weights (torchft's ``init_sync``). A replica healed in the middle
    of its run (paused past the lighthouse's heartbeat, or its healer lost during a heal) ends its step with the
    others, then its ``run()`` ends and begins again at the healer's position (``restarts`` counts these). A
    replica whose configuration differs from the replicas training (shard count, batch size, DiLoCo's
    ``local_steps``, models, optimizers, versions) or whose ``replica_id`` is its healer's is refused in one line
    where it would heal; at the end of ``run()`` the replicas of the last quorum compare their weights. With
    ``every_step=False`` there is no quorum nor averaging at each step: :class:`~torchbearer_dist.DiLoCo`'s
    meetings go through it instead (``distributed_callbacks(fault_tolerant=..., local_steps=H)``).

    ``group()`` says whom the replica talks to now: :class:`~torchbearer_dist.ReduceMetrics` given it (as
    :func:`~torchbearer_dist.distributed_callbacks` does) reduces each pass's figures over the live replicas, as
    the fail-fast mode does over the ranks. ``state[WRITER]`` is True on one live replica, where
    :class:`~torchbearer_dist.Checkpoint` writes. ``evaluate()`` and ``predict()`` (after ``run()``) take a quorum of
    the replicas that call them, nothing healed, so that their figures and predictions cover every replica's shard:
    they wait up to ``timeout`` for the replicas that ended the last run, go on over fewer in one line, and refuse
    in one line where replicas in their quorum still train. A stop that any callback sets on any replica
    (``state[STOP_TRAINING]``) stops every live replica after the same committed step: it rides in the next
    step's gradient buckets (with DiLoCo's meetings, it is agreed at the end of the pass).

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
        restarted (bool): this process is a launcher's restart of a replica that trained before (None: read
            torchrun's ``TORCHELASTIC_RESTART_COUNT`` and SLURM's ``SLURM_RESTART_COUNT``). A restarted replica
            that finds no live replica to heal from at its first quorum, and resumed no checkpoint, stops in one
            line rather than train the whole run again alone (the others finished or were lost meanwhile)

    Raises:
        ValueError: a bad option
        RuntimeError: torchft is missing; the lighthouse does not answer (named); no quorum of ``min_replicas``
            within ``timeout``; this replica cannot join or heal (another configuration, model or version, a taken
            ``replica_id``: on it only); it was paused until nobody was left; the replicas ended with different
            weights; a process group

    State Requirements:
        - :attr:`torchbearer.state.MODEL`, :attr:`torchbearer.state.OPTIMIZER` and any other held module
          or optimizer: averaged, gated and healed
        - :attr:`torchbearer.state.HISTORY`, :attr:`torchbearer.state.CALLBACK_LIST`: healed; the stop
          agreement's companion is appended to the list for each run
        - :attr:`torchbearer.state.STOP_TRAINING`: read and set (a stop held until every replica has it)

    .. warning:: A synchronization point at every step, with the lighthouse and the live replicas.
    """

    def __init__(self, lighthouse=None, replica_id=None, min_replicas=1, timeout=60.0, host=None,
                 loss_reduction='auto', every_step=True, restarted=None):
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
        if restarted is not None and not isinstance(restarted, bool):
            raise ValueError('restarted should be None, True or False, but given {!r}'.format(restarted))
        self.restarted = restarted
        self.replica, self._signals, self._local = None, None, None
        self.writer = False  # whether this replica wrote checkpoints at the last step (the quorum's first)
        self.heals = 0  # heals of this replica in its runs (the first step's init_sync not counted)
        self.restarts = 0  # runs this replica ended and began again at its healer's position (a heal mid-run)
        self._restart = None  # that position, from a heal mid-run until the run begins again there
        self._quorum = self._refusal = None  # the last quorum voted in; why a heal's payload was not loaded
        self._news = []  # the lines of a heal, said once the quorum's vote let this replica in
        self._ended_with = 0  # the replicas of the last run's last quorum, whom evaluate() and predict() wait for
        # A stop set by a callback on any replica ends every live replica after the same committed step (the
        # request rides in the gradient buckets' stop slot); DiLoCo's meetings hold their own agreement.
        self._agreement = StopAgreement(self, carrier=self, group=self.group)
        self._reset()

    def _reset(self):
        self._state = self._pending = None
        self._open = self._in_step = self._meets = self._passing = self._evaluating = False
        self._joining = False  # in the quorum of a pass's start (see meet)
        self._commit, self._gated = None, []
        self._asking = None  # a quorum asked for and not yet taken (see _start_quorum)
        self._buckets = None  # the gradient buckets (GradientBuckets over the live replicas), with every_step

    # --- the run: a replica per run(), its quorum at every step ----------------------------------------

    def on_start(self, state):
        restart, self._restart = self._restart, None
        if restart is not None and self.replica is not None:  # the run that begins again where the healer is
            self._state = weakref.ref(state)
            weakref.finalize(state, FaultTolerantAllReduce._expire, weakref.ref(self), self._state)
            self._pending, self._open = restart, False  # its first step (or meeting) takes a quorum of its own
            return
        # evaluate() and predict() set their loader before on_start, run() does not: they take the live replicas'
        # quorum without healing, and their figures and predictions are reduced over it (ReduceMetrics)
        passing = state.get(torchbearer.GENERATOR) is not None
        self._release()
        self._reset()
        self._evaluating = passing
        # A process group (torchrun, launch(), srun) is this replica group: its ranks start, fail and heal together.
        self._local = DistGroup() if collectives.world_size() > 1 else None
        if self._local is not None:
            # every rank the same layout, before any network wait; their values are made alike at the first quorum
            models.check_same_tensors(_held.synchronised(state), 0)
        self._state = weakref.ref(state)  # not kept alive by this callback: a run that raises frees it
        self._summed = loss_is_summed(state, self.loss_reduction)
        replica_id = self.replica_id or socket.gethostname().replace(':', '_')
        # Ctrl-C and SIGTERM end this replica within 1.5 s, wherever they land, in one line (see _signals)
        self._signals = _signals.SignalStop(replica_id, lambda: (self._state and self._state(), self._passing))
        try:
            # a pass outside run() waits for the replicas that ended the run itself, and goes on with fewer (_join_pass)
            # A training run's steps take their quorum behind forward (torchft's asynchronous quorum)
            self.replica = Replica(self.lighthouse, replica_id, self._load, self._save,
                                   1 if passing else self.min_replicas, self.timeout, self.host, group=self._local,
                                   deferred=self.every_step and not passing)
        except BaseException:  # no lighthouse, say: the signal handlers found at the start go back
            self._release()
            raise
        self._clock, self._peers = PauseClock(), 0  # how long this process was stopped; the last quorum's replicas
        weakref.finalize(state, FaultTolerantAllReduce._expire, weakref.ref(self), self._state)
        if passing:
            self._join_pass(self._ended_with)  # kept by _reset: the replicas of the last run's end
            return
        if self.every_step:
            self._gate(state)
        self._start_quorum()  # a replica that starts late heals here, before its first epoch begins
        if self._local is not None and self.replica.manager.current_step() == 0:  # a group joining later heals
            # torchft's first-step sync (init_sync) takes each rank's weights from the replica at its rank's index in
            # the quorum (rank i from replica i % n): the group's ranks again take those of rank 0, which came from
            # the quorum's first replica, as every group's rank 0 did (SLURM test at min_replicas=2, helper)
            self._align_group(state)
        self._check_not_alone_again(state)
        self._open = True  # this quorum serves the first step

    def _join_pass(self, wanted):
        """The quorum of an ``evaluate()`` or ``predict()``: the replicas that call it, nothing healed (every one
        holds the weights its run ended with). Quorums are taken again, for up to ``timeout``, until it holds the
        ``wanted`` replicas that ended the last run together; where fewer come, the pass goes on over those, in
        one line. A replica still training in the quorum (its run goes on) refuses this one."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._start_quorum(heal=False)
            manager = self.replica.manager
            if manager.participating_rank() is None:  # the quorum's highest step is a training replica's
                what = self._what()
                self._release()
                raise _heal.Refused('this replica cannot {}: replicas in its quorum are still training (their run() '
                                    'goes on); call it once every replica\'s run() has ended'.format(what))
            live = manager.num_participants()
            if live >= wanted:
                return
            if time.monotonic() >= deadline:
                self._say('replica {} {}s over {} of the {} replicas that ended the last run: the others did not join '
                          'within {:g} s (lost, or not calling {}())'.format(
                              self.replica.replica_id, self._what(), live, wanted, self.timeout, self._what()))
                return
            time.sleep(PASS_POLL)

    def _what(self):
        """``'evaluate'`` or ``'predict'``: the pass outside ``run()`` this replica is in."""
        state = self._state()
        predicting = state is not None and _torchbearer.predicting(state[torchbearer.CALLBACK_LIST])
        return 'predict' if predicting else 'evaluate'

    def _align_group(self, state):
        """Every tensor the Trial holds (models, optimizers' parameters) takes the group's rank 0's values."""
        models.broadcast_tensors([t for _, t in _held.synchronised(state)], group=self._local)

    def _check_not_alone_again(self, state):
        """A launcher's restart (see ``restarted``) alone at its first quorum, nothing healed nor resumed: the
        others finished or were lost meanwhile, and training the run again from the start would fork it."""
        restarts = [(name, os.environ.get(name, '')) for name in RESTART_COUNTS]
        restarts = [(name, int(value)) for name, value in restarts if value.isdigit() and int(value) > 0]
        restarted = bool(restarts) if self.restarted is None else self.restarted
        manager = self.replica.manager
        if not restarted or manager.num_participants() != 1 or self.heals or state[torchbearer.HISTORY] or \
                state[torchbearer.EPOCH] or self._pending is not None:
            return
        how = '{}={}'.format(*restarts[0]) if restarts and self.restarted is None else 'restarted=True'
        self._release()
        raise _heal.Refused('this replica was started again ({}) but finds no live replica to heal from: the others '
                            'finished or were lost meanwhile; it stops rather than train the whole run again alone '
                            '(start every replica anew for a new run, or resume from a checkpoint)'.format(how))

    def _start_quorum(self, shrink_only=False, heal=True, defer=False):
        """Ask for the next quorum and take it (:meth:`_take_quorum`); ``defer``: a training step's, taken at the
        step's first use of its group (its first gradient bucket, say), so that it forms while forward runs."""
        self._asking = (shrink_only, heal, self._clock.take(), self.heals)
        self._ask(shrink_only, heal, wait=not defer)
        if not defer:
            self._take_quorum()

    def _ask(self, shrink_only, heal, wait):
        self._trained = self.replica.manager.current_step() > 0  # before this quorum: a heal moves it to the healer's
        self._refusal = None
        try:  # a heal inside a step is loaded at should_commit: its backward may still hold the weights
            self.replica.start_quorum(shrink_only, heal=heal, wait=wait, load=not self._in_step)
        except _heal.Refused:
            raise
        except RuntimeError as e:
            self._quorum_failed(e)

    def _quorum_failed(self, error):
        """No quorum: where this process was stopped inside the call, that stop is why."""
        during = self._clock.take()
        if not during:
            raise error
        raise _heal.Refused('this replica was stopped for {:.1f} s (SIGSTOP, a paused VM, swap) while it asked for a '
                            'quorum, past the quorum\'s timeout, and the others went on without it; it stops rather '
                            'than train on from where it was (restart it: it heals from the live replicas, or starts '
                            'anew)'.format(during)) from None

    def _take_quorum(self):
        """The quorum asked for, taken: the vote of a new one (a new quorum without a replica refused), the checks
        of a replica stopped meanwhile, the writer, a heal's lines. Nothing where none is in flight."""
        asking, self._asking = self._asking, None
        if asking is None:
            return
        shrink_only, heal, stopped, heals = asking
        manager = self.replica.manager
        for attempt in range(VOTES):
            if attempt:  # another replica refused: a new quorum without it
                self._ask(shrink_only, heal, wait=True)
            else:
                try:
                    self.replica.finish_quorum()
                except _heal.Refused:
                    raise
                except RuntimeError as e:
                    self._quorum_failed(e)
            stopped = max(stopped, self._clock.take())  # stopped inside the call, its quorum formed after
            if not self._vote(self._trained, heal):
                break  # nobody refused: the quorum trains; else a new one, without the replica refused
        else:
            raise _heal.Refused('this replica found {} quorums in a row with a replica refused in it; restart it'
                                .format(VOTES))
        count = manager.num_participants()
        if stopped and self._peers > 1 and count == 1 and self.heals == heals and self.replica.members()[1] == 1:
            raise _heal.Refused('this replica was stopped for {:.1f} s (SIGSTOP, a paused VM, swap) and finds no live '
                                'replica since: the others finished or were lost meanwhile; it stops rather than '
                                'train on alone from where it was (restart it to start anew)'.format(stopped))
        self._peers = count
        self.writer = self._state()[WRITER] = self._group().rank() == 0
        news, self._news = self._news, []
        for line in news:  # a heal's, once the vote let this replica in
            self._say(line)

    def _vote(self, trained, heal=True):
        """At a quorum of new membership, every replica's configuration through one all-reduce (see ``_vote``):
        this one refused raises its line; True where another was refused (every replica then takes a new quorum)."""
        manager = self.replica.manager
        quorum, refusal, self._refusal = _torchft.quorum_id(manager), self._refusal, None
        # Every replica of the quorum votes, one that heals in a deferred quorum too (it counts for nothing there);
        # in the quorum of a pass (heal=False) only those at its highest step (one behind refuses: see _join_pass)
        rank, count = self.replica.members() if heal else (manager.participating_rank(), manager.num_participants())
        new, self._quorum = quorum != self._quorum, quorum  # every quorum's id, alone too: torchft's, tracked exactly
        if not new or rank is None or count == 1:  # nothing new to compare
            if refusal is not None:  # healed at a quorum already voted in (cannot be: a new replica is a new quorum)
                raise _heal.Refused(refusal)
            return False
        state = self._state()
        model, optimizers = _heal.layouts(state)
        rows = _vote.table(count, rank, _vote.row(self._config(state), trained, model, optimizers))
        if not self.replica.vote_sum(rows):  # a replica lost meanwhile: this quorum's steps are dropped anyway
            self._quorum = None
            return refusal is not None  # a payload not loaded: a new quorum, where this replica heals again
        refused = _vote.decide(rows.tolist(), self.replica.replica_id)
        trainers = any(rows[:, _vote.COLUMNS.index('trained')].tolist())
        if rank in refused or (refusal is not None and trainers):  # the heal's words, where it healed from a trainer
            self._news = []
            self._release()  # out of the quorums at once: the others take a new one without this replica
            raise _heal.Refused(refusal if refusal is not None and trainers else refused[rank])
        if refused:
            self._say('replica {} goes on without rank{} {} of the quorum (refused: another configuration, or a '
                        'replica_id taken)'.format(self.replica.replica_id, 's' * (len(refused) > 1),
                                                   ', '.join(str(r) for r in sorted(refused))))
        return bool(refused) or refusal is not None

    def on_start_training(self, state):
        if self.replica is None:  # only run() trains: one that began with a loader left in state, not evaluate()
            raise RuntimeError('this run of the Trial began without joining the replicas (its on_start found the '
                               'loader of an earlier pass in state[generator]: after a run that raised?); call '
                               'trial.run() in a new process, or build the Trial again')
        if self.every_step:
            self._agreement.open_run(state)
        pending, self._pending = self._pending, None
        if pending is not None and pending['epoch'] == state[torchbearer.EPOCH] and pending['batches'] > 0:
            _midepoch.resume_epoch(state, pending, None)  # the healer's next batch is this replica's next
        self._passing = True
        params = [p for _, p in trainable(state)]
        if self.every_step and (self._buckets is None or not self._buckets.same_params(params)):
            if self._buckets is not None:  # the last epoch's: the trainable set changed since
                self._buckets.detach()
            # The fail-fast mode's engine over the quorum: each bucket sent as backward fills it, the average (over
            # the replicas live at the step) complete before backward() returns. Buckets stay in reverse
            # registration order (no reordering broadcast, which a replica joining later would not match), and
            # a non-finite average goes to the gate as it is.
            self._buckets = GradientBuckets(params, overlap=True, average=not self._summed, group=self._group(),
                                            reorder=False, check_finite=False)
            self._buckets.attach()

    def on_sample(self, state):
        if self.replica is None or not self.every_step:
            return
        self._commit, self._in_step = None, True
        self._buckets.arm()  # this step's backward passes average over its quorum
        if self._open:
            self._open = False
        else:  # the epoch's last step takes no new replica: healed there, it would have no batch left to go on from
            # Taken at the step's first collective (its first gradient bucket): the quorum forms while forward runs
            self._start_quorum(shrink_only=state[torchbearer.BATCH] + 1 >= state[torchbearer.STEPS], defer=True)

    def on_backward(self, state):
        if self._in_step:
            self._buckets.complete()  # where torch could not queue the end of backward, or no backward synchronized

    def on_step_training(self, state):
        if self.replica is not None:
            self._take_quorum()  # a step that neither averaged nor stepped an optimizer
        self._in_step = False
        if self._buckets is not None:
            self._buckets.disarm()
        if self._restart is not None:  # healed mid-run: end this run, begin again at the healer's position (on_end)
            state[torchbearer.STOP_TRAINING] = True

    def meet(self, engine, trained, quorum=True, join=False):
        """DiLoCo's meeting through torchft (:func:`~torchbearer_dist.sync.meeting.meet`); True if committed.

        After a quorum (``quorum``), where a replica behind heals and counts as not trained; one that ends a pass
        takes no new replica (``shrink_only``: healed there, it would start a pass with no batch left). ``join``:
        the empty meeting at the start of a pass that begins a round, whose quorum takes the replicas waiting to
        join (where every meeting ends a pass, as with ``local_steps`` equal to an epoch's steps, they would
        otherwise wait until the others' runs end, and then train alone); one joins at the pass's first batch.
        """
        if not quorum and not self._open:  # no quorum at this run's start (it began again after a heal mid-run)
            return False
        if quorum:
            heals, self._meets, self._joining, state = self.heals, True, join, self._state()
            try:
                self._start_quorum(shrink_only=not join and (state[torchbearer.BATCH] + 1 >= state[torchbearer.STEPS]
                                                             or not self._passing))
            finally:
                self._meets = self._joining = False
            trained = trained and self.heals == heals
        committed = meeting.meet(engine, self._group(trained), self.replica.should_commit)
        if not committed:
            self._dropped('meeting')
        return committed

    def group(self):
        """Whom this replica agrees with now (a stop, DiLoCo's last pass): the live replicas, every rank of the
        live groups (the interface of :mod:`torchbearer_dist.sync.group`); None where it talks to nobody: outside
        a run, or in a run that ends after this step to begin again at its healer's position."""
        return None if self.replica is None or self._restart is not None else self._group()

    # --- the stop carrier (callbacks/stop.py): a stop request rides in the last bucket's stop slot ---------------

    def _after_step(self, state):
        """Called by the stop agreement's companion after every other callback of the step: nothing left to do
        (the buckets were disarmed at ``on_step_training``)."""

    def _carried_stop(self):
        """Whether this step's gradients brought a stop request, in a step torchft committed (then every replica of
        the step has it); None without buckets."""
        buckets = self._buckets
        if buckets is None:
            return None
        return bool(buckets.synced and buckets.stop and self._commit)

    def _request_stop(self):
        self._buckets.request_stop()

    def _change_word(self, state):
        return False  # the trainable set is followed at each pass's start (on_start_training), not within one

    def _say(self, line):
        """One event line per replica: said by rank 0 of a replica group, whose ranks decide every step, heal and
        comparison alike (k copies of each line before)."""
        if self._signals is not None and self._signals.signum is not None:
            return  # this replica is stopping: its stop's line is its last
        if self._local is None or self._local.rank() == 0:
            _events.say(line)

    def _group(self, trained=None):
        """Whom this step averages over: the live replicas; with a replica group of several ranks, every rank of
        the live groups (within the group, then with the same rank of the others: see ``HierarchicalGroup``).
        ``trained`` (a DiLoCo meeting): whether this replica trained since the last meeting; those that did not
        (healed since) count for nothing (see ``QuorumGroup``). A group's ranks heal and train together."""
        quorum = QuorumGroup(self.replica.manager, trained, ready=self._take_quorum, process_group=self.replica.group)
        return quorum if self._local is None else HierarchicalGroup(self._local, quorum)

    def _dropped(self, what):
        """One line: this step (or meeting) was not committed on any replica, and why (torchft's first line)."""
        if self._signals is not None:  # a signal torchft swallowed (a future's callback) failed it: stop now
            self._signals.raise_taken()
        state, error = self._state(), self.replica.manager.errored()
        why = 'another replica failed it, or too few replicas were live' if error is None else \
            str(getattr(error, 'original_exception', error)).strip()
        self._say('replica {} dropped the {} at epoch {}, batch {} on every replica: {}'.format(
            self.replica.replica_id, what, state[torchbearer.EPOCH], state[torchbearer.BATCH],
            (why.splitlines() or ['?'])[0][:200]))

    def _gate(self, state):
        """Every optimizer of the Trial steps only if torchft commits the step (decided once per step): torchbearer
        has no hook between the closure and the update, so each held optimizer's ``step`` is shadowed for the run
        (an instance attribute, removed at its end), as torchft's own ``OptimizerWrapper`` does."""
        for optimizer in _heal.optimizers(state):
            original = optimizer.step

            def step(closure=None, _original=original):
                loss = closure() if closure is not None else None
                if self._commit is None:
                    self._take_quorum()
                    self._buckets.complete()
                    self._commit = self.replica.should_commit()  # loads a heal staged in a deferred quorum
                    if self._refusal is not None:  # that heal's payload refused (see _load): leave now
                        refusal = self._refusal
                        self._release()
                        raise _heal.Refused(refusal)
                    if not self._commit:
                        self._dropped('step')
                if self._commit:
                    _original()
                return loss
            optimizer.step = step
            self._gated.append(optimizer)

    def on_end_training(self, state):
        self._passing = False  # DiLoCo's meeting at the run's end comes after

    def _config(self, state):
        """What every replica of a run must share, sent with a heal and checked by the healed replica."""
        loader = state.get(torchbearer.TRAIN_GENERATOR)
        sampler = distributed_sampler(loader) if loader is not None else None
        callbacks = state.get(torchbearer.CALLBACK_LIST)
        diloco = [c for c in (callbacks or ()) if getattr(c, 'meetings', None) is self]
        return _heal.config(replica_id=self.replica.replica_id, shards=getattr(sampler, 'num_replicas', None),
                            batch_size=getattr(getattr(loader, 'batch_sampler', None), 'batch_size', None),
                            local_steps=diloco[0].local_steps if diloco else None)

    def _save(self):
        state = self._state()
        loader = state.get(torchbearer.GENERATOR)
        sampler = distributed_sampler(loader) if loader is not None else None
        # At a step's quorum: about to train batch state[BATCH]; at a meeting: after it; else at the start of the
        # run or of a pass (history holds the epochs before it).
        training = (self._in_step or self._meets) and not self._joining
        position = {'epoch': state[torchbearer.EPOCH] if training else len(state[torchbearer.HISTORY]),
                    'batches': state[torchbearer.BATCH] + self._meets if training else 0,
                    'batch_size': getattr(getattr(loader, 'batch_sampler', None), 'batch_size', None),
                    'world_size': getattr(sampler, 'num_replicas', 1)}
        return _heal.capture(state, position, self._config(state))

    def _load(self, payload):
        state = self._state()
        try:
            position = _heal.restore(state, payload, 'a healthy replica', self._config(state))
        except _heal.Refused as e:  # the quorum's vote decides who is refused: the healer may be the odd one
            self._refusal = str(e)
            return
        if self.replica.manager.current_step() > 0:  # not the first step's init_sync: a heal
            self.heals += 1
        if not (self._in_step or self._meets):
            self._pending = position  # at the run's start: its first epoch begins at the healer's position
            epochs = state[torchbearer.MAX_EPOCHS]
            if position['epoch'] >= epochs:  # refused at the vote, in one line: nothing of this run left to train
                self._refusal = ('this replica healed at epoch {}, batch {}, past the end of its own run of {} '
                                 'epoch{}: the replica it healed from trains more epochs and goes on; start every '
                                 'replica with the same number of epochs'.format(
                                     position['epoch'], position['batches'], epochs, 's' * (epochs != 1)))
                return
            if self.heals:
                self._news.append('replica {} healed from a live replica: it goes on at epoch {}, batch {}'.format(
                    self.replica.replica_id, position['epoch'], position['batches']))
            return
        # Mid-run (a pause past the heartbeat, a heal cut short before): this step or meeting ends together with
        # the healer's, then the healer trains its next batch; this replica's Trial cannot jump there inside its
        # loop, so the run ends after this step and begins again there (on_end), on the same Manager.
        epoch, steps = state[torchbearer.EPOCH], state[torchbearer.STEPS]
        target = dict(position, batches=position['batches'] + self._in_step)
        here = (epoch, 0) if self._joining else (epoch, state[torchbearer.BATCH] + 1)
        if (target['epoch'], target['batches']) == here:
            return  # already there
        if self._joining:  # at a pass's start, before any step: no step to end the run after
            raise _heal.Refused('this replica healed at the start of epoch {} (it was at the start of epoch {}), where '
                                'its run cannot go on from the healer\'s position; restart it: it heals again at its '
                                'start'.format(target['epoch'], epoch))
        if target['batches'] >= steps:
            raise _heal.Refused('this replica healed at the last step of epoch {} (it was at epoch {}, batch {}), '
                                'where its run cannot go on from the healer\'s position; restart it: it heals again '
                                'at its start'.format(target['epoch'], epoch, state[torchbearer.BATCH]))
        self._restart = target
        self._news.append('replica {} healed mid-run at epoch {}, batch {} (it was at epoch {}, batch {}): its run '
                          'ends after this step and begins again there'.format(
                              self.replica.replica_id, target['epoch'], target['batches'], epoch,
                              state[torchbearer.BATCH]))

    # --- the end of a run, however it ends ------------------------------------------------------------------

    def on_end(self, state):
        _torchbearer.forget_loader(state)  # after run(), evaluate() or predict(): the next on_start tells them apart
        self._agreement.close_run(state)
        if self._state is None or self._state() is not state:
            return
        if self._restart is not None and self.replica is not None:
            self.restarts += 1  # the same replica and Manager: the new run's first step takes the next quorum
            state[torchbearer.SELF].run(state[torchbearer.MAX_EPOCHS], verbose=0)  # the printer of this run goes on
            return
        try:
            if not self._evaluating:
                self._ended_with = self.replica.manager.num_participants() if self.replica is not None else 0
                self._agree_at_end(state)
        finally:
            self._release()

    def _agree_at_end(self, state):
        """The replicas of the last quorum compare their weights' fingerprints: a difference is an error.

        The trainable parameters; with DiLoCo's meetings (``every_step=False``) every buffer of the held modules
        too (BatchNorm's statistics), which each meeting makes the same on every replica. Averaging at every step
        leaves each replica its own buffers: they are not compared there.
        """
        manager, group = self.replica.manager, self._group()
        count, rank = group.size(), group.rank()
        if count <= 1 or rank is None or manager.errored() is not None:
            return
        params = [p for _, p in trainable(state)] + ([] if self.every_step else held_buffers(state))
        mine = torch.stack([fingerprint(p) for p in params]) if params else torch.zeros(1, 2)
        rows = torch.zeros(count, 2, dtype=torch.int64, device=group.device())  # within a group under nccl: a GPU's
        rows[rank] = fingerprint(mine)
        whole = group.all_reduce(rows, SUM).wait()
        if not whole or manager.errored() is not None:
            _events.say('replica {} could not compare its final weights with the others: a replica was lost after '
                        'the last step'.format(self.replica.replica_id))
            return
        differ = [i for i in range(count) if not torch.equal(rows[i], rows[rank])]
        if differ:
            raise RuntimeError('the replicas of the last quorum ended the run with different weights{}: this one '
                               '(replica {}, rank {} of {}) differs from ranks {}; they trained different models, a '
                               'bug of torchbearer_dist: please report it with every replica\'s output'.format(
                                   '' if self.every_step else ' or buffers', self.replica.replica_id, rank, count,
                                   differ))

    @staticmethod
    def _expire(ref, state_ref):
        self = ref()  # torchbearer skips on_end when run() raises: the replica goes when that run's state does
        if self is not None and self._state is state_ref:
            self._release()

    def _release(self):
        if self._buckets is not None:
            self._buckets.detach()
        for optimizer in self._gated:
            optimizer.__dict__.pop('step', None)
        self._gated = []
        replica, self.replica = self.replica, None
        if replica is not None:
            self._clock.stop()
            replica.shutdown()
        self._state = None
        signals, self._signals = self._signals, None
        if signals is not None:  # the handlers found at the start, back
            signals.close()
