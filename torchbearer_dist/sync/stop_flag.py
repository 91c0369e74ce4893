"""A stop request that travels in one value a step, its all-reduce in flight while the step computes."""
import time

import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives


class StopFlag:
    """One float64 summed over the ranks each step: posted before the step, read after it.

    Example:

        .. code-block:: python

            flag = StopFlag()
            for batch in loader:
                flag.post(asked)          # this rank's request, in flight from here
                train_step(batch)
                if flag.read():           # some rank asked: every rank learns it at this same step
                    break

    Attributes:
        bytes_sent (int): payload handed to the all-reduces so far (8 bytes a step)
        wait_seconds (float): the seconds :meth:`read` waited for them

    .. warning:: :meth:`post` is a synchronization point: every rank must post at the same steps.
    """

    def __init__(self):
        self._flag = None
        self.bytes_sent, self.wait_seconds = 0, 0.0

    def post(self, asked):
        """Start the all-reduce of this rank's request (``asked``: bool) and return at once."""
        flag = torch.tensor([1.0 if asked else 0.0], dtype=torch.float64,
                            device=collectives.comm_device(torch.device('cpu')))
        self._flag = (flag, dist.all_reduce(flag, async_op=True))
        self.bytes_sent += flag.element_size()

    def read(self):
        """Whether any rank asked, in the flag posted last (False when none is in flight); waits for it."""
        if self._flag is None:
            return False
        flag, work = self._flag
        self._flag = None
        began = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - began
        return flag.item() > 0
