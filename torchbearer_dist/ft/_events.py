"""(private) The fault-tolerant mode's one line per event (a heal, a run begun again, a lost peer), on stderr."""
import sys

#: Every event line begins with it.
PREFIX = 'torchbearer_dist: '


def say(line):
    """Write ``line``, one line, to stderr at once (replicas' outputs interleave in a terminal or a job log)."""
    print(PREFIX + line, file=sys.stderr, flush=True)
