"""A replica of tests/ft/_replica.py started ahead: ``python _spare_replica.py GATE <_replica.py's options>``.

It imports torch, torchbearer and torchft at once, then waits for the file ``GATE`` and runs _replica.py with the
options that follow: a replica that joins the others within a fraction of a second when the test asks, instead
of after the seconds its imports take on a loaded machine.
"""
import os
import runpy
import sys
import time

import torch  # noqa: F401 (the imports this process makes ahead)
import torchbearer  # noqa: F401
import torchft  # noqa: F401

import torchbearer_dist  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


if __name__ == '__main__':
    gate = sys.argv.pop(1)
    end = time.monotonic() + 600
    while not os.path.exists(gate):
        if time.monotonic() > end:
            sys.exit('error: no gate {} within 600 s'.format(gate))
        time.sleep(0.01)
    sys.argv[0] = os.path.join(HERE, '_replica.py')
    runpy.run_path(sys.argv[0], run_name='__main__')
