"""A torchft Manager's face for unit tests of the fault-tolerant groups (``sync.group.QuorumGroup``): no torchft.

The stand-in plays the other replicas of the quorum: each sum adds what they send, in order. Real torchft
replicas: ``tests/callbacks/test_metrics_over_replicas.py`` and ``tests/ft/``.
"""
import torch.distributed as dist


class StandInManager:
    """``participants`` replicas, this one at ``rank`` (None: outside the quorum); ``others`` is what the other
    replicas add to each sum, in order; ``error``: torchft fails every sum, recording it for ``errored()`` and
    leaving the tensor corrupted (torchft: "the tensor must be zeroed before being used")."""

    def __init__(self, participants=2, rank=0, others=(), error=None):
        self.participants, self.rank, self.others, self.error = participants, rank, list(others), error
        self.sent, self.failed = [], None

    def num_participants(self):
        return self.participants

    def participating_rank(self):
        return self.rank

    def allreduce(self, tensor, reduce_op):
        assert reduce_op == dist.ReduceOp.SUM
        self.sent.append(tensor.clone())
        if self.others:
            tensor += self.others.pop(0)
        if self.error is not None:
            self.failed = self.error
            tensor.add_(100)
        return self

    def wait(self):
        return True

    def errored(self):
        return self.failed
