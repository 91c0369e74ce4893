"""A replica of tests/ft/_replica.py started ahead: ``python _spare_replica.py GATE <_replica.py's options>``.

It imports torch, torchbearer and torchft at once, then waits for the file ``GATE`` and runs _replica.py with the
options that follow: a replica that joins the others within a fraction of a second when the test asks, instead
of after the seconds its imports take on a loaded machine.
"""
import os
import runpy
import sys
import time

os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'FATAL')  # before torch is imported, as _replica.py does

import torch  # noqa: F401,E402 (the imports this process makes ahead)
import torchbearer  # noqa: F401,E402
import torchft  # noqa: F401,E402

import torchbearer_dist  # noqa: F401,E402

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
