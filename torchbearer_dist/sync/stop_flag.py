"""A stop request that travels in one value every few steps, in flight while the ranks compute."""
import time

import torch
import torch.distributed as dist

from torchbearer_dist.sync import collectives

#: Steps between two stop flags. A flag every step, read at the next, cost 4 % of the CNN's throughput
#: on two 100 Mbit/s hosts (gloo's threads woken every step beside the computing ones); one every 8
#: steps costs an eighth of that, and a stop still reaches every rank within 16 steps, at any H.
PERIOD = 8


class StopFlag:
    """One float64 summed over the ranks every ``period`` steps, read when the next one is posted.

    :meth:`step` is called before each step with this rank's request. At the first step of each
    period it waits for the flag posted a period before (long arrived, unless the ranks drifted a
    period apart), then posts the requests made since. Every rank reads the same flag at the same
    step, so a stop asked for at step k stops every rank after the same step, at most ``2 * period``
    steps later; :meth:`drain` reads a flag still in flight (at the end of a pass).

    Example:

        .. code-block:: python

            flag = StopFlag()
            for batch in loader:
                if flag.step(asked):      # some rank asked: every rank learns it at this same step
                    stop_after_this_step = True
                train_step(batch)

    Args:
        period (int): steps between two flags (default :data:`PERIOD`)

    Attributes:
        bytes_sent (int): payload handed to the all-reduces so far (8 bytes a flag)
        wait_seconds (float): the seconds spent waiting for them

    .. warning:: :meth:`step` is a synchronization point: every rank must call it at the same steps.
    """

    def __init__(self, period=None):
        self.period = period or PERIOD
        self._flag, self._steps, self._asked = None, 0, False
        self.bytes_sent, self.wait_seconds = 0, 0.0

    def step(self, asked):
        """Before a step: note this rank's request (bool); at a period's start, read the last flag, post a new one.

        Returns:
            bool: whether the flag read now says some rank asked (False between reads)
        """
        self._asked = self._asked or asked
        self._steps += 1
        if (self._steps - 1) % self.period:
            return False
        arrived = self.drain()
        flag = torch.tensor([1.0 if self._asked else 0.0], dtype=torch.float64,
                            device=collectives.comm_device(torch.device('cpu')))
        self._flag, self._asked = (flag, dist.all_reduce(flag, async_op=True)), False
        self.bytes_sent += flag.element_size()
        return arrived

    def drain(self):
        """Whether the flag in flight, if any, says some rank asked; waits for it."""
        if self._flag is None:
            return False
        flag, work = self._flag
        self._flag = None
        began = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - began
        return flag.item() > 0
