"""A DiLoCo meeting over torchft's quorum (sync/meeting.meet handed a QuorumGroup), a stand-in Manager: no torchft.

The stand-in plays the other replicas of the quorum: each all-reduce adds what they send, in order.
"""
import torch

from torchbearer_dist.sync import group, meeting
from torchbearer_dist.sync.diloco import OuterStep


class _Manager:
    """A Manager's face for meet(): ``participants`` replicas, this one at ``rank``; ``others`` is what the other
    replicas add to each all-reduce, in order; ``commit`` is torchft's verdict."""

    def __init__(self, participants=1, rank=0, others=(), commit=True):
        self.participants, self.rank, self.others, self.commit = participants, rank, list(others), commit
        self.sums = []

    def num_participants(self):
        return self.participants

    def participating_rank(self):
        return self.rank

    def allreduce(self, tensor, reduce_op):
        assert reduce_op == torch.distributed.ReduceOp.SUM
        self.sums.append(tensor.clone())
        if self.others:
            tensor += self.others.pop(0)
        return self

    def wait(self):
        return True

    def should_commit(self):
        return self.commit

    def errored(self):
        return None


def _meet(manager, engine, trained):
    """The fault-tolerant mode's meeting: over the quorum's replicas that trained, committed as torchft says."""
    return meeting.meet(engine, group.QuorumGroup(manager, trained), manager.should_commit)


def _engine(anchor, local):
    param = torch.nn.Parameter(torch.tensor(anchor))
    engine = OuterStep([param])
    with torch.no_grad():
        param.copy_(torch.tensor(local))
    return engine, param


def test_a_meeting_torchft_does_not_commit_is_dropped_every_parameter_back_at_the_anchor():
    engine, param = _engine([1.0, 2.0], [0.5, 1.0])
    assert _meet(_Manager(commit=False), engine, trained=True) is False
    assert torch.equal(param.detach(), torch.tensor([1.0, 2.0])) and torch.equal(engine.anchor[0], param.detach())
    assert engine.steps == 0 and engine.meeting is None and engine.group is group.WORLD


def test_a_committed_meeting_steps_the_anchor_with_the_mean_over_the_replicas_that_trained():
    engine, param = _engine([1.0, 2.0], [0.5, 1.0])  # pseudo-gradient [0.5, 1.0]; the other replica's [1.5, -1.0]
    others = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1.5, -1.0]) / 2,
              torch.zeros(1, dtype=torch.float64)]  # its flag at rank 0, its share of the mean, its stop flag
    manager = _Manager(participants=2, rank=1, others=others)
    assert _meet(manager, engine, trained=True) is True
    assert torch.equal(manager.sums[0], torch.tensor([0.0, 1.0], dtype=torch.float64))  # this one trained, at rank 1
    assert torch.equal(param.detach(), torch.tensor([0.0, 2.0])) and torch.equal(engine.anchor[0], param.detach())
    assert engine.steps == 1


def test_a_replica_that_just_healed_sends_zeros_and_takes_the_others_outer_step():
    engine, param = _engine([1.0, 2.0], [1.0, 2.0])  # healed: it holds the anchor
    manager = _Manager(participants=2, rank=0, others=[torch.tensor([0.0, 1.0], dtype=torch.float64),
                                                       torch.tensor([1.5, -1.0]), torch.zeros(1, dtype=torch.float64)])
    assert _meet(manager, engine, trained=False) is True
    assert [s.abs().sum().item() for s in manager.sums] == [0.0, 0.0, 0.0]  # nothing of its own counts
    # The mean over the one replica that trained is its pseudo-gradient, whole.
    assert torch.equal(param.detach(), torch.tensor([-0.5, 3.0])) and engine.steps == 1


def test_nobody_trained_no_outer_step_but_the_meeting_commits():
    engine, param = _engine([1.0, 2.0], [1.0, 2.0])
    manager = _Manager(participants=2, rank=0, others=[torch.zeros(2, dtype=torch.float64)])
    assert _meet(manager, engine, trained=False) is True
    assert len(manager.sums) == 1 and engine.steps == 0 and torch.equal(param.detach(), torch.tensor([1.0, 2.0]))
