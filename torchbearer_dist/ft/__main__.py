"""``python -m torchbearer_dist.ft``: run the lighthouse of a fault-tolerant job (see :func:`lighthouse.main`)."""
import sys

from torchbearer_dist.ft.lighthouse import main

sys.exit(main())
