"""Each mutant of the heartbeat's verdict and sampling, of the fold that decides every stop (:func:`fold` and its
rules, :func:`decide`) and of the live group that applies it must fail tests/runtime/test_verdict.py or
tests/runtime/test_decision.py.

Run from the repository root: ``python tests/scripts/verdict_mutants.py [NAME ...]``. Each mutant is
made in a copy of the package and the tests in a temporary folder (the working tree is never changed),
the tests run there, and a table says which tests failed; the exit status is 1 when a mutant passes every
test, no longer applies, or when the unchanged copy fails one (CI runs it: .ci/run). About four minutes on
one core.

The mutants are the three that passed every verdict test before (issue 34), a change of each bound that
docs/troubleshooting.rst states for the heartbeat, the two that passed every fast runtime test before
(issue 44: the heartbeat's cause never published, ``timed_out`` at a third of the limit), and rules of
the fold, of :func:`decide`, of the applier and of the launcher's watch (which rank it names, whether it restarts).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

VERDICT, WATCHDOG = 'torchbearer_dist/runtime/_decision.py', 'torchbearer_dist/runtime/_watchdog.py'
TIMING = 'torchbearer_dist/runtime/_timing.py'
DECISION, LIVE = 'torchbearer_dist/runtime/_decision.py', 'torchbearer_dist/runtime/_live.py'
TESTS = ['tests/runtime/test_decision.py', 'tests/runtime/test_verdict.py']
#: The simulation's properties (most of its time): run once every other test passed.
PROPERTIES = ('test_no_healthy_schedule_is_ever_judged_failed or test_every_failure_is_named_within_its_bound or '
              'test_errors_raised_on_several_ranks_at_once')

#: name: (file, text, replacement), the text found exactly once; or a list of them, the first that applies
MUTANTS = {
    # the three of issue 34
    'pause reset at limit/3': (TIMING, 'ASLEEP = 0.5', 'ASLEEP = 1 / 3'),
    'died without its half-limit clause': (
        VERDICT, 'if (rank in dead and sample.began > dead[rank] and\n'
                 '                dead[rank] - changed.get(rank, now) <= limit * Timing.DIED_BEATING):',
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
    'pause reset at the limit': (TIMING, 'ASLEEP = 0.5', 'ASLEEP = 1.0'),
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
    'watch once per beat': (TIMING, 'SAMPLES_PER_BEAT = 4', 'SAMPLES_PER_BEAT = 1'),
    'the round begins after its read': (WATCHDOG, '_decision.Sample(began, time.monotonic(),',
                                        '_decision.Sample(time.monotonic(), time.monotonic(),'),
    # the two of issue 44: the heartbeat never publishes the cause it found (its rank's peers then wait for their
    # own verdict, or for gloo); a killed peer whose beat rank 0 last saw change a third of the limit before is
    # taken for silent
    'heartbeat cause not published': (DECISION, "((PUBLISH, cause, True),) * publish + ((WAKE, True),)",
                                      "((WAKE, True),)"),
    'timed_out at limit/3': (TIMING, 'TIMED_OUT = 0.5', 'TIMED_OUT = 1 / 3'),
    'timed_out at 2/3 of the limit': (TIMING, 'TIMED_OUT = 0.5', 'TIMED_OUT = 2 / 3'),
    # the fold (its events, then decide()'s rules): who publishes, who is woken, who waits for readers, what ends a read
    **{name: (DECISION, text, replacement) for name, text, replacement in [
        ('fold: heartbeat publishes where the store fails', 'publish = e.cause is not None and e.store_answers',
         'publish = e.cause is not None and not e.store_answers'),
        ('fold: heartbeat wakes nobody', '* publish + ((WAKE, True),)', '* publish'),
        ('fold: Ctrl-C publishes nothing', '((PUBLISH, causes.interrupted(env.rank), False), (WAKE, False))',
         '((WAKE, False),)'),
        ("fold: the heartbeat's cause not kept", 'return replace(s, heartbeat=cause), ', 'return s, '),
        ('fold: later facts change a decision', 'if s.decided is not None:', 'if False:'),
        ('fold: readers never waited for', 'if e.read or e.now >= s.until:', 'if True:'),
        ('fold: a dead peer never ends a read', 'dead = tuple(sorted(e.memory.dead)) if not s.timed_out and',
         'dead = () if not s.timed_out and'),
        ('fold: the peers never stopped', '* d.publish + ((STOP_PEERS,),) * d.stop_peers', '* d.publish'),
        ('fold: the peers stopped at every wait', '(d.stop_peers and e.kind != TICK)', 'd.stop_peers'),
        ('decide: only rank 0 publishes in the block', 'published = rank == 0 or cause.rank > 0 or',
         'published = rank == 0 or'),
        ('decide: rank 0 waits for no reader', 'readers=rank == 0, skip=cause.rank, stop_peers=True)',
         'readers=False, skip=cause.rank, stop_peers=True)'),
        # the launcher's watch: which rank it names, what it passes on, whether it starts its ranks again
        ('launch: a peer failure named first', "rank = ([r for r in unfinished if e.states[r] == 'own']",
         "rank = ([r for r in unfinished if e.states[r] == 'peer']"),
        ("launch: restarts after a rank's Ctrl-C", 'not in (130, -signal.SIGINT)', 'not in (-signal.SIGINT,)'),
        ('launch: restarts after a pre-emption signal', 'not s.preempted and e.exitcodes[rank]', 'e.exitcodes[rank]'),
        ('launch: the pre-emption signal not passed on', 'forward = ((FORWARD, running),) *', 'forward = () *')]},
    # the applier: it publishes what it is told to, over the connection it is told
    "applier: the heartbeat's connection publishes nothing": (
        LIVE, '_diagnosis.publish(self.client if args[1] else self.store, args[0])',
        'args[1] or _diagnosis.publish(self.client, args[0])'),
    "gloo's failed connect: the interface even where the heartbeat named a peer": (
        DECISION, ' and not (f.error == UNCONNECTED and f.heartbeat):', ':'),
    "applier: the main thread's connection publishes nothing": (
        LIVE, '_diagnosis.publish(self.client if args[1] else self.store, args[0])',
        'args[1] and _diagnosis.publish(self.client, args[0])'),
}


def _copy(root, into):
    ignore = shutil.ignore_patterns('__pycache__', '*.pyc')
    for name in ('torchbearer_dist', 'tests'):
        shutil.copytree(os.path.join(root, name), os.path.join(into, name), ignore=ignore)
    shutil.copy(os.path.join(root, 'pyproject.toml'), into)


def _read(folder, path):
    with open(os.path.join(folder, path)) as f:
        return f.read()


def _failing(folder, first=True):
    """The names of the tests that fail in ``folder``'s copy (its package imported first): with ``first``, the
    first that fails, the quick tests before the simulation's properties."""
    outs = []
    for selection in ('not ({})'.format(PROPERTIES), PROPERTIES):
        outs.append(subprocess.run([sys.executable, '-m', 'pytest', *TESTS, '-q', '-n', '0', '-p', 'no:cacheprovider',
                                    '-rf', '-k', selection] + (['-x'] if first else []),
                                   cwd=folder, capture_output=True, text=True).stdout)
        failed = sorted(set(re.findall(r'^(?:FAILED|ERROR) \S+?(?:::(\w+)|$)', outs[-1], re.M)) - {''}) or (
            ['(an error: run the tests)'] if re.search(r'^ERROR ', outs[-1], re.M) else [])
        if failed and first or ' passed' not in outs[-1]:
            break
    return failed, '\n'.join(outs)


def main(names):
    started = time.monotonic()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    survivors = []
    with tempfile.TemporaryDirectory() as folder:
        _copy(root, folder)
        where = subprocess.run([sys.executable, '-c', 'import torchbearer_dist; print(torchbearer_dist.__file__)'],
                               cwd=folder, capture_output=True, text=True).stdout
        assert where.startswith(folder), ('the copy is not the package imported there', where)
        failed, out = _failing(folder, first=False)
        if failed or out.count(' passed') != 2:
            print(out)
            print('the unchanged copy fails: {}'.format(failed))
            return 1
        for name in names or MUTANTS:
            found = [(path, text, replacement) for path, text, replacement in
                     (MUTANTS[name] if isinstance(MUTANTS[name], list) else [MUTANTS[name]])
                     if os.path.exists(os.path.join(folder, path)) and _read(folder, path).count(text) == 1]
            if not found:
                print('{:44} NO LONGER APPLIES: update it'.format(name), flush=True)
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
            print('{:44} {}'.format(name, ', '.join(failed) or 'SURVIVED'), flush=True)
            if not failed:
                survivors.append(name)
    print('{} mutants, {} survived, {:.0f} s'.format(len(names or MUTANTS), len(survivors), time.monotonic() - started))
    return 1 if survivors else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
