"""``python -m torchbearer_dist.ft``: run the lighthouse of a fault-tolerant job (see :func:`lighthouse.main`)."""
import sys

from torchbearer_dist.ft.lighthouse import main

if __name__ == '__main__':  # importing the module (pkgutil, doctest) starts nothing
    sys.exit(main())
