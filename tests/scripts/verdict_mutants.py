"""Each mutant of the heartbeat's verdict and sampling must fail tests/runtime/test_verdict.py.

Run from the repository root: ``python tests/scripts/verdict_mutants.py [NAME ...]``. Each mutant is
made in a copy of the package and the tests in a temporary folder (the working tree is never changed),
the verdict tests run there, and a table says which tests failed; the exit status is 1 when a mutant
passes every test, or when the unchanged copy fails one. About two minutes on one core.

The mutants are the three that passed every verdict test before (issue 34), and a change of each bound
that docs/troubleshooting.rst states for the heartbeat.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

VERDICT, WATCHDOG = 'torchbearer_dist/runtime/_verdict.py', 'torchbearer_dist/runtime/_watchdog.py'
TIMING = 'torchbearer_dist/runtime/_timing.py'

#: name: (file, text, replacement), the text found exactly once; or a list of them, the first that applies
MUTANTS = {
    # the three of issue 34
    'pause reset at limit/3': (VERDICT, 'if now - memory.awake > limit / 2:', 'if now - memory.awake > limit / 3:'),
    'died without its half-limit clause': (
        VERDICT, 'if rank in dead and sample.began > dead[rank] and dead[rank] - changed.get(rank, now) <= limit / 2:',
        'if rank in dead and sample.began > dead[rank]:'),
    'rank 0 master silent at 1.45x': (VERDICT, 'now - max(sample.ended, resumed) > limit or',
                                      'now - max(sample.ended, resumed) > 1.45 * limit or'),
    'rank 0 silent at 1.45x': (VERDICT, 'elif sample.began - changed[rank] > limit:',
                               'elif sample.began - changed[rank] > (1.45 if rank == 0 else 1) * limit:'),
    # "noticed once it has been silent for the rendezvous timeout", and two beats and a quarter later
    'silent at 1.1x': (VERDICT, 'elif sample.began - changed[rank] > limit:',
                       'elif sample.began - changed[rank] > 1.1 * limit:'),
    'silent at 0.95x': (VERDICT, 'elif sample.began - changed[rank] > limit:',
                        'elif sample.began - changed[rank] > 0.95 * limit:'),
    'silent counted from the round before': (VERDICT, 'last[rank], changed[rank] = value, sample.ended',
                                             'last[rank], changed[rank] = value, sample.began'),
    'master silent at 1.1x': (VERDICT, 'now - max(sample.ended, resumed) > limit or',
                              'now - max(sample.ended, resumed) > 1.1 * limit or'),
    'master silent at 0.9x': (VERDICT, 'now - max(sample.ended, resumed) > limit or',
                              'now - max(sample.ended, resumed) > 0.9 * limit or'),
    # "a whole job paused and resumed goes on training"; a rank paused past the limit names its own pause
    'pause reset at the limit': (VERDICT, 'if now - memory.awake > limit / 2:', 'if now - memory.awake > limit:'),
    'own pause at 2x': (VERDICT, '        if now - memory.awake > limit:\n            frozen',
                        '        if now - memory.awake > 2 * limit:\n            frozen'),
    'own pause wins for no time': (VERDICT, 'now - memory.frozen[1] <= limits.limit', 'now - memory.frozen[1] <= 0'),
    # a local peer that dies is named within a beat and a half; one that left is not named
    'died without a round after': (VERDICT, 'sample.began > dead[rank] and', 'True and'),
    'died once seen gone a round later': (VERDICT, 'sample.began > dead[rank] and',
                                          'sample.began > dead[rank] + limits.limit / 2 and'),
    # the beat: every second, or four times per rendezvous timeout where that is shorter
    'beat every 2 s': [(WATCHDOG, '_INTERVAL = 1.0', '_INTERVAL = 2.0'),
                       (TIMING, 'self.beat = min(1.0, limit / 4)', 'self.beat = min(2.0, limit / 4)')],
    'two beats per limit': [(WATCHDOG, '_BEATS_PER_LIMIT = 4', '_BEATS_PER_LIMIT = 2'),
                            (TIMING, 'self.beat = min(1.0, limit / 4)', 'self.beat = min(1.0, limit / 2)')],
    'watch once per beat': (WATCHDOG, 'while not self._stop.wait(self.interval / 4):',
                            'while not self._stop.wait(self.interval):'),
    'the round begins after its read': (WATCHDOG, '_verdict.Sample(began, time.monotonic(),',
                                        '_verdict.Sample(time.monotonic(), time.monotonic(),'),
}


def _copy(root, into):
    ignore = shutil.ignore_patterns('__pycache__', '*.pyc')
    for name in ('torchbearer_dist', 'tests'):
        shutil.copytree(os.path.join(root, name), os.path.join(into, name), ignore=ignore)
    shutil.copy(os.path.join(root, 'pyproject.toml'), into)


def _read(folder, path):
    with open(os.path.join(folder, path)) as f:
        return f.read()


def _failing(folder):
    """The names of the verdict tests that fail in ``folder``'s copy (its package imported first)."""
    out = subprocess.run([sys.executable, '-m', 'pytest', 'tests/runtime/test_verdict.py', '-q', '-n', '0',
                          '-p', 'no:cacheprovider', '-rf'], cwd=folder, capture_output=True, text=True).stdout
    return sorted(set(re.findall(r'^FAILED \S+::(\w+)', out, re.M))), out


def main(names):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    survivors = []
    with tempfile.TemporaryDirectory() as folder:
        _copy(root, folder)
        where = subprocess.run([sys.executable, '-c', 'import torchbearer_dist; print(torchbearer_dist.__file__)'],
                               cwd=folder, capture_output=True, text=True).stdout
        assert where.startswith(folder), ('the copy is not the package imported there', where)
        failed, out = _failing(folder)
        if failed or ' passed' not in out:
            print(out)
            print('the unchanged copy fails: {}'.format(failed))
            return 1
        for name in names or MUTANTS:
            found = [(path, text, replacement) for path, text, replacement in
                     (MUTANTS[name] if isinstance(MUTANTS[name], list) else [MUTANTS[name]])
                     if os.path.exists(os.path.join(folder, path)) and _read(folder, path).count(text) == 1]
            if not found:
                print('{:40} NO LONGER APPLIES: update it'.format(name), flush=True)
                survivors.append(name)
                continue
            path, text, replacement = found[0]
            target, original = os.path.join(folder, path), _read(folder, path)
            with open(target, 'w') as f:
                f.write(original.replace(text, replacement))
            try:
                failed, out = _failing(folder)
            finally:
                with open(target, 'w') as f:
                    f.write(original)
            print('{:40} {}'.format(name, ', '.join(failed) or 'SURVIVED'), flush=True)
            if not failed:
                survivors.append(name)
    return 1 if survivors else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
