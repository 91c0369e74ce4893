"""A rank of ``_fault_rank.py`` whose main thread's failure path is traced (``test_failure_trace.py``).

``python tests/runtime/_traced_rank.py TRACE_FILE <_fault_rank.py's arguments>`` runs that rank under
:func:`sys.setprofile` (the main thread only): the trace opens when the package's process group, its block
having raised, hands the caught error to the runtime (the first call ``process_group`` makes after it was
resumed), and closes when that call returns the error to raise, the one line. Every function called in
between is written to ``TRACE_FILE``, one ``module function`` a line, in the order called; the group's
teardown (``end``), which runs whatever ended the block, comes after.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fault_rank  # noqa: E402


class Trace:
    """The profile function: finds the process group's frame, then records what its first call after its
    resumption calls."""

    def __init__(self, code):
        self.code, self.resumed, self.window, self.calls, self.closed = code, 0, None, [], False

    def __call__(self, frame, event, arg):
        if self.closed:
            return
        if event == 'return' and frame is self.window:
            self.closed = True
            return
        if event != 'call':
            return
        module = frame.f_globals.get('__name__', '')
        if self.window is not None:
            if module.startswith('torchbearer_dist'):
                self.calls.append('{} {}'.format(module, frame.f_code.co_qualname))
        elif frame.f_code is self.code:
            self.resumed += 1  # 1: entered (the group made), 2: resumed as the block ended
        elif self.resumed >= 2 and frame.f_back is not None and frame.f_back.f_code is self.code and \
                module.startswith('torchbearer_dist'):
            self.window = frame
            self.calls.append('{} {}'.format(module, frame.f_code.co_qualname))


def main():
    path, argv = sys.argv[1], sys.argv[2:]
    import torchbearer_dist.runtime.group as group
    trace = Trace(group.process_group.__wrapped__.__code__)
    sys.setprofile(trace)
    try:
        _fault_rank.main(argv)
    finally:
        sys.setprofile(None)
        with open(path, 'w') as f:
            f.write(''.join(line + '\n' for line in trace.calls))


if __name__ == '__main__':
    main()
